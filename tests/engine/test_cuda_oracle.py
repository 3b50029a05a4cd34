"""ModelRunner on CUDA against transformers in fp32 on the CPU: greedy tokens and logits per attention backend,
eager and replayed through decode CUDA graphs — the token-exact promise of the CPU oracle tests, on a GPU.

fp32 throughout: the Triton kernels multiply fp32 in IEEE precision and PyTorch keeps TF32 off for matmuls by
default, so the same tolerance as on CPU applies (``REL_TOL``)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import MAX_NEW, REL_TOL, GreedyDriver, greedy_generate, hf_logits, rel_err

from agentserve.executor.runner import DecodeItem, ModelRunner, PrefillChunk

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BACKENDS = ["torch", "triton"]


def cuda_runner(case, attention: str, graphs: str = "off") -> ModelRunner:
    return ModelRunner(case.path, dtype="float32", device="cuda", num_blocks=96, block_size=8,
                       attention_backend=attention, cuda_graphs=graphs)


@pytest.fixture(autouse=True)
def _no_tf32():
    """The oracle's tolerance assumes IEEE fp32 products; a test process that turned TF32 on would break it."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("attention", BACKENDS)
@pytest.mark.parametrize("chunk_size", [None, 7])
def test_greedy_on_cuda_matches_transformers(case, attention, chunk_size):
    got = greedy_generate(cuda_runner(case, attention), case.prompts, MAX_NEW, chunk_size)
    assert got == case.expected


@pytest.mark.parametrize("attention", BACKENDS)
def test_logits_on_cuda_match_transformers(case, attention):
    """A resumed chunk beside a cold one, then a decode batch of two lengths: every row against transformers."""
    runner = cuda_runner(case, attention)
    a, b = case.prompts[3], case.prompts[1]
    tables = [list(range(0, 16)), list(range(16, 32))]
    runner.prefill([PrefillChunk(a[:50], 0, tables[0])])
    got = runner.prefill([PrefillChunk(a[50:], 50, tables[0]), PrefillChunk(b, 0, tables[1])], all_logits=True)
    assert got[0].device.type == "cuda"
    assert rel_err(got[0].cpu(), hf_logits(case.hf, a)[50:]) < REL_TOL
    assert rel_err(got[1].cpu(), hf_logits(case.hf, b)) < REL_TOL
    nxt = [7, 11]
    dec = runner.decode([DecodeItem(nxt[0], len(a), tables[0]), DecodeItem(nxt[1], len(b), tables[1])]).cpu()
    assert rel_err(dec[0], hf_logits(case.hf, a + nxt[:1])[-1]) < REL_TOL
    assert rel_err(dec[1], hf_logits(case.hf, b + nxt[1:])[-1]) < REL_TOL


class GraphDriver(GreedyDriver):
    """Decodes through rung 0's captured graphs (``runner.decode(..., rung=0)``)."""

    def decode(self, seqs: list[int], token_ids: list[int]) -> torch.Tensor:
        items = [DecodeItem(t, self.cached[s], self.tables[s]) for s, t in zip(seqs, token_ids, strict=True)]
        for s in seqs:
            self.cached[s] += 1
        return self.runner.decode(items, rung=0)


def test_graph_replayed_decode_matches_transformers(case):
    runner = cuda_runner(case, "triton", graphs="auto")
    assert runner.graphs_unavailable() is None
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        runner.capture_graphs(rung=0, sm_count=torch.cuda.get_device_properties(0).multi_processor_count)
        replayed = count_replays(runner)
        driver = GraphDriver(runner, len(case.prompts))
        seqs = list(range(len(case.prompts)))
        got = driver.generate(seqs, driver.prefill(seqs, case.prompts), MAX_NEW)
    torch.cuda.synchronize()
    runner.drop_graphs()
    assert replayed == [MAX_NEW - 1]  # every decode step ran from a graph, none fell back to eager
    assert got == case.expected


def count_replays(runner: ModelRunner) -> list[int]:
    """Wrap the runner's graph replay; the returned one-item list counts the steps a graph served."""
    graphs, count = runner.graphs, [0]
    replay = graphs.replay

    def counted(*args):
        out = replay(*args)
        count[0] += out is not None
        return out

    graphs.replay = counted
    return count
