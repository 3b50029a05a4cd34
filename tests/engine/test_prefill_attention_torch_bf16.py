"""``prefill_attention = torch-bf16``: PyTorch's flash attention over bf16 copies of a prefill chunk's queries, keys
and values, fp32 results (what ``auto`` runs where the CPU has AMX tiles and prefill rows multiply in bf16).

On any CPU (PyTorch runs bf16 everywhere; only its speed needs AMX): attention equal to float64 attention over the
same bf16-rounded inputs within the softmax weights' bf16 rounding, on scattered tables, after cached prefixes,
across the flash path's query blocks, over fp16 and fp32 caches; decodes riding in the step untouched; a hybrid
runner's logits within the bf16 tolerance of transformers, whole or resumed; ``auto`` takes it exactly where the CPU
has AMX (the check faked both ways); a clear error off a float32 CPU model."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import BF16_TOL, hf_logits, random_prompts, rel_err, whole_and_resumed
from hypothesis import given, settings
from hypothesis import strategies as st

import agentserve.executor.attention as attention
import agentserve.executor.attention.torch_backend as torch_backend
import agentserve.executor.model as model_module
from agentserve.executor.attention import AttentionBatch, create_backend, torch_prefill_dtype
from agentserve.executor.attention.torch_backend import CPU_ROW_BLOCK, TorchAttention
from agentserve.executor.errors import EngineError
from agentserve.executor.linear import ALL_ROWS, bf16_rows
from agentserve.executor.runner import ModelRunner

CPU = torch.device("cpu")
F32 = torch.float32
WEIGHTS_TOL = 8e-3  # vs float64 on the same bf16-rounded inputs: the weights and the output rounded to bf16


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def reference(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, start: int, group: int) -> torch.Tensor:
    """Causal attention in float64 of q [n, heads, dim] (positions start..) over keys/values [start + n, kv, dim],
    every input rounded to bf16."""
    n, heads, dim = q.shape
    out = torch.empty(n, heads, dim, dtype=torch.float64)
    for i in range(n):
        for h in range(heads):
            s = bf16(keys[: start + i + 1, h // group]) @ bf16(q[i, h]) * dim**-0.5
            out[i, h] = torch.softmax(s, 0) @ bf16(vals[: start + i + 1, h // group])
    return out


def one_chunk(backend: TorchAttention, q, k, v, k_cache, v_cache, table: list[int], start: int) -> torch.Tensor:
    n, bs = q.shape[0], k_cache.shape[1]
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(start, start + n)])
    batch = AttentionBatch(False, [n], [start], [table], slots)
    return backend.forward(q, k, v, k_cache, v_cache, backend.plan(batch)).view(q.shape)


@settings(max_examples=25, deadline=None)
@given(kv_heads=st.integers(1, 2), group=st.sampled_from([1, 3, 4]), dim=st.sampled_from([16, 64]),
       block_size=st.sampled_from([1, 16]), start=st.integers(0, 80), n=st.sampled_from([2, 9, CPU_ROW_BLOCK + 3]),
       f16=st.booleans(), seed=st.integers(0, 2**16))
def test_chunks_match_float64_attention_on_their_bf16_inputs(kv_heads, group, dim, block_size, start, n, f16, seed):
    g = torch.Generator().manual_seed(seed)
    heads, cache_dtype = kv_heads * group, torch.float16 if f16 else F32
    need = -(-(start + n) // block_size)
    table = torch.randperm(need + 4, generator=g)[:need].tolist()
    k_cache, v_cache = (torch.randn(need + 4, block_size, kv_heads, dim, generator=g).to(cache_dtype)
                        for _ in range(2))
    q, k, v = (torch.randn(n, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    backend = TorchAttention(heads, kv_heads, dim, block_size, CPU, prefill_dtype=torch.bfloat16)
    got = one_chunk(backend, q, k, v, k_cache, v_cache, table, start)
    assert got.dtype == F32
    keys, vals = (c[table].flatten(0, 1)[: start + n].float() for c in (k_cache, v_cache))
    want = reference(q, keys, vals, start, group)
    assert ((got.double() - want).norm() / want.norm()).item() < WEIGHTS_TOL


def test_its_attention_calls_take_a_bounded_set_of_shapes(monkeypatch):
    """PyTorch keeps the kernels it makes for each bf16 flash-attention shape for the life of the process (a server's
    memory grew without bound with the (rows, keys) pairs its resumes met): every call takes query rows a multiple of
    ``ROW_PAD`` per folded head and keys a multiple of ``KEY_PAD``, and the results still match float64 attention."""
    heads, kv_heads, dim, bs = 4, 2, 16, 16
    shapes = set()

    def recording(q, k, v, attn_mask=None, scale=None):
        shapes.add((q.shape[2], k.shape[2]))
        return flash(q, k, v, attn_mask=attn_mask, scale=scale)

    flash = torch_backend._flash_cpu
    monkeypatch.setattr(torch_backend, "_flash_cpu", recording)
    backend = TorchAttention(heads, kv_heads, dim, bs, CPU, prefill_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(11)
    k_cache, v_cache = (torch.randn(40, bs, kv_heads, dim, generator=g) for _ in range(2))
    table = torch.randperm(40, generator=g).tolist()
    for start, n in [(0, 2), (0, 300), (5, 9), (63, 2), (64, 17), (130, 70), (301, 33), (333, 280)]:
        q, k, v = (torch.randn(n, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
        got = one_chunk(backend, q, k, v, k_cache, v_cache, table, start)
        keys, vals = (c[table].flatten(0, 1)[: start + n] for c in (k_cache, v_cache))
        want = reference(q, keys, vals, start, group=heads // kv_heads)
        assert ((got.double() - want).norm() / want.norm()).item() < WEIGHTS_TOL, (start, n)
    group_rows = heads // kv_heads * torch_backend.ROW_PAD
    assert all(rows % group_rows == 0 and keys % torch_backend.KEY_PAD == 0 for rows, keys in shapes), shapes


def test_a_riding_decode_is_untouched_and_chunks_differ_from_fp32_by_bf16_rounding():
    heads, kv_heads, dim, bs = 4, 2, 32, 8
    g = torch.Generator().manual_seed(8)
    lens, starts, tables = [29, 1, 18], [37, 20, 0], [list(range(0, 9)), list(range(10, 13)), [13, 14, 15]]
    slots = torch.tensor([t[p // bs] * bs + p % bs for t, s, n in zip(tables, starts, lens, strict=True)
                          for p in range(s, s + n)])
    batch = AttentionBatch(False, lens, starts, tables, slots)
    q, k, v = (torch.randn(48, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    cache = [torch.randn(20, bs, kv_heads, dim, generator=g).half() for _ in range(2)]
    outs = []
    for dtype in (torch.bfloat16, None):
        backend = TorchAttention(heads, kv_heads, dim, bs, CPU, prefill_dtype=dtype)
        k_cache, v_cache = (c.clone() for c in cache)
        outs.append(backend.forward(q, k, v, k_cache, v_cache, backend.plan(batch)).view(48, heads, dim))
    got, want = outs
    assert torch.equal(got[29], want[29])  # the decode riding in the step
    for rows in (slice(0, 29), slice(30, 48)):
        assert 0 < rel_err(got[rows], want[rows]) < 2e-2


def test_in_a_forward_of_bf16_rows_it_returns_the_bf16_it_computed():
    """Under ``bf16_rows(ALL_ROWS)`` (every row multiplies in bf16: the o-projection rounds to bf16 anyway) a batch of
    chunks comes back in bf16 holding the values it returns in fp32 elsewhere; with a decode riding, in fp32."""
    heads, kv_heads, dim, bs = 4, 2, 32, 8
    g = torch.Generator().manual_seed(3)
    cache = [torch.randn(20, bs, kv_heads, dim, generator=g).half() for _ in range(2)]
    q, k, v = (torch.randn(48, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    backend = TorchAttention(heads, kv_heads, dim, bs, CPU, prefill_dtype=torch.bfloat16)
    for lens, starts in (([30, 18], [5, 0]), ([29, 1, 18], [37, 20, 0])):  # the second with a riding decode
        tables = [list(range(0, 9)), list(range(10, 13)), [13, 14, 15]][: len(lens)]
        slots = torch.tensor([t[p // bs] * bs + p % bs for t, s, n in zip(tables, starts, lens, strict=True)
                              for p in range(s, s + n)])
        batch = AttentionBatch(False, lens, starts, tables, slots)
        outs = []
        for rows in (None, ALL_ROWS):
            with bf16_rows(rows):
                outs.append(backend.forward(q, k, v, *(c.clone() for c in cache), backend.plan(batch)))
        fp32, in_bf16_rows = outs
        assert fp32.dtype == F32
        assert in_bf16_rows.dtype == (F32 if len(lens) == 3 else torch.bfloat16)
        assert torch.equal(in_bf16_rows.float(), fp32)


@pytest.mark.parametrize("setting", ["torch-bf16", "torch"])
def test_a_hybrid_runner_hands_bf16_over_without_changing_a_bit(bf16_checkpoints, monkeypatch, setting):
    """A prefill of bf16 rows hands RMSNorm's output to the qkv and gate/up products, and the attention's to the
    o-projection, in bf16: the logits are bitwise those of handing them over in fp32 (each product rounds its
    input to bf16 itself)."""
    tokens = random_prompts([70], seed=5)[0]
    for case in ("qwen2_tied_bias", "qwen3_headdim"):
        runner = ModelRunner(bf16_checkpoints[case][0], dtype="float32", device="cpu", num_blocks=64, block_size=8,
                             weights="hybrid", prefill_attention=setting)
        handed = whole_and_resumed(runner, tokens, 45)
        with monkeypatch.context() as m:
            m.setattr(model_module, "input_dtype", lambda linear: None)
            m.setattr(torch_backend, "bf16_forward", lambda: False)
            widened = whole_and_resumed(runner, tokens, 45)
        for a, b in zip(handed, widened, strict=True):
            assert torch.equal(a, b), case


def test_only_hybrid_matrices_are_handed_bf16_attention(bf16_checkpoints, monkeypatch):
    """On packed fp16 matrices (no bf16 product to round for it) ``torch-bf16`` keeps returning fp32: no bf16 result
    to widen again."""
    path = bf16_checkpoints["qwen2_tied_bias"][0]
    seen: dict[str, set[torch.dtype]] = {}

    def recording(weights: str, forward):
        def run(*args):
            out = forward(*args)
            seen.setdefault(weights, set()).add(out.dtype)
            return out
        return run

    for weights in ("hybrid", "fp16"):
        runner = ModelRunner(path, dtype="float32", device="cpu", num_blocks=64, block_size=8, weights=weights,
                             prefill_attention="torch-bf16")
        monkeypatch.setattr(runner.attention, "forward", recording(weights, runner.attention.forward))
        whole_and_resumed(runner, random_prompts([40], seed=2)[0], 20)
    assert seen == {"hybrid": {torch.bfloat16}, "fp16": {F32}}


def test_a_hybrid_runner_prefills_within_bf16_tolerance_of_transformers(bf16_checkpoints):
    path, hf = bf16_checkpoints["qwen3_headdim"]
    runs = {}
    for setting in ("torch-bf16", "torch"):
        runner = ModelRunner(path, dtype="float32", device="cpu", num_blocks=64, block_size=8, weights="hybrid",
                             prefill_attention=setting)
        assert runner.prefill_attention == (setting if setting == "torch-bf16" else None)
        tokens = random_prompts([70], seed=21)[0]
        whole, resumed = whole_and_resumed(runner, tokens, 45)
        assert rel_err(whole, hf_logits(hf, tokens)) < BF16_TOL
        assert rel_err(resumed, whole[45:]) < BF16_TOL
        runs[setting] = whole
    assert 0 < rel_err(runs["torch-bf16"], runs["torch"]) < BF16_TOL  # it ran in bf16, and within bf16


def backend_choice(setting: str, bf16_rows: bool) -> tuple[object, torch.dtype | None]:
    backend = create_backend("auto", 4, 2, 32, 16, CPU, F32, torch.float16, setting, bf16_rows)
    return backend.prefill_kernel, backend.prefill_dtype


@pytest.mark.parametrize("amx", [True, False])
def test_auto_takes_it_exactly_where_the_cpu_has_amx_and_rows_are_bf16(monkeypatch, amx):
    monkeypatch.setattr(attention, "cpu_has_amx", lambda: amx)
    kernel, dtype = backend_choice("auto", bf16_rows=True)
    assert (dtype == torch.bfloat16) is amx
    if amx:
        assert kernel is None  # no compiled kernel beside it
    assert backend_choice("auto", bf16_rows=False)[1] is None  # fp32 (or fp16-packed) prefill products stay fp32
    assert backend_choice("torch-bf16", bf16_rows=False) == (None, torch.bfloat16)  # its flag, on any matrices
    assert backend_choice("torch", bf16_rows=True) == (None, None)
    assert torch_prefill_dtype("auto", CPU, torch.bfloat16, True) is None  # a bf16 model attends in bf16 anyway


def test_it_fails_clearly_off_a_float32_cpu_model():
    with pytest.raises(EngineError, match="'torch-bf16' is unavailable: it needs a float32 model on the CPU"):
        create_backend("auto", 4, 2, 32, 16, CPU, torch.bfloat16, None, "torch-bf16", True)
    with pytest.raises(EngineError, match="'torch-bf16' is unavailable"):
        torch_prefill_dtype("torch-bf16", torch.device("cuda"), F32, True)
    with pytest.raises(EngineError, match="unknown prefill_attention 'bf17'"):
        torch_prefill_dtype("bf17", CPU, F32, True)


def test_the_fp16_cache_cast_to_bf16_goes_through_fp32_to_the_same_values():
    """Every fp16 bit pattern: the two-step cast the bf16 copies take gives PyTorch's direct cast's values."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    direct, two_step = every.to(torch.bfloat16), torch_backend._cast(every, torch.bfloat16)
    assert two_step.dtype == torch.bfloat16
    assert torch.equal(direct.isnan(), two_step.isnan())
    kept = ~direct.isnan()
    assert torch.equal(direct[kept].view(torch.int16), two_step[kept].view(torch.int16))
    assert torch_backend._cast(every, torch.float32).dtype == torch.float32
