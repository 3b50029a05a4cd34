"""Test helpers for the engine: tiny random-weight checkpoints saved by transformers, the transformers
greedy oracle, and a minimal greedy driver of ModelRunner that allocates KV blocks linearly."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from agentserve.executor.attention import cpu_kernel
from agentserve.executor.kernels import build
from agentserve.executor.linear import fp16_packing_available
from agentserve.executor.runner import DecodeItem, ModelRunner, PrefillChunk

VOCAB = 300
PROMPT_LENGTHS = [5, 17, 40, 70]  # each architecture case's prompts
MAX_NEW = 64  # tokens generated in the oracle comparisons
REL_TOL = 1e-4  # max |got - ref| / max |ref| for fp32 logits against transformers
BF16_TOL = 3e-2  # prefill logits through bf16 products (activations rounded to 8 significant bits)
COMMON = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,  # no eos: both sides must generate exactly max_new_tokens
    pad_token_id=None,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# name -> (config class, family-specific settings)
SPECS: dict[str, tuple[type, dict]] = {
    "llama3_untied": (transformers.LlamaConfig, dict(tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE)),
    "llama_tied": (transformers.LlamaConfig, dict(tie_word_embeddings=True)),
    "qwen2_tied_bias": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen3_headdim": (transformers.Qwen3Config, dict(tie_word_embeddings=False, head_dim=32)),
}
ARCH = {"llama3_untied": "LlamaForCausalLM", "llama_tied": "LlamaForCausalLM",
        "qwen2_tied_bias": "Qwen2ForCausalLM", "qwen3_headdim": "Qwen3ForCausalLM"}


def build_hf_model(name: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny fp32 model with every weight random (biases and norm gains too, so they are all tested)."""
    config_cls, extra = SPECS[name]
    config = config_cls(**COMMON, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model


def save_checkpoint(model: transformers.PreTrainedModel, path: Path, **kwargs) -> Path:
    model.save_pretrained(path, **kwargs)
    return path


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int], max_new: int) -> list[int]:
    """transformers' own greedy ``generate`` for one unpadded prompt."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             min_new_tokens=max_new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def cpu_has(flag: str) -> bool:
    """Whether this CPU's flags (the line the compiled library's build key records) list ``flag``."""
    return flag in build._cpu_flags().split()


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


def hf_logits(model: transformers.PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def whole_and_resumed(runner: ModelRunner, tokens: list[int], split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All logits of ``tokens`` prefilled at once (blocks 0-9), and those of ``tokens[split:]`` prefilled after
    ``tokens[:split]`` as a second chunk (blocks 10-19)."""
    whole = runner.prefill([PrefillChunk(tokens, 0, list(range(10)))], all_logits=True)[0]
    runner.prefill([PrefillChunk(tokens[:split], 0, list(range(10, 20)))])
    resumed = runner.prefill([PrefillChunk(tokens[split:], split, list(range(10, 20)))], all_logits=True)[0]
    return whole, resumed


class GreedyDriver:
    """Drives a ModelRunner for several sequences: sequence ``i`` owns blocks ``[i*n, (i+1)*n)``."""

    def __init__(self, runner: ModelRunner, num_seqs: int) -> None:
        self.runner = runner
        per_seq = runner.num_blocks // num_seqs
        self.tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_seqs)]
        self.cached = [0] * num_seqs  # tokens whose K/V are in the cache

    def prefill(self, seqs: list[int], tokens: list[list[int]], chunk_size: int | None = None) -> torch.Tensor:
        """Feed ``tokens[j]`` to sequence ``seqs[j]``, all sequences' chunks batched in each call.

        Returns the last-token logits per sequence."""
        last: dict[int, torch.Tensor] = {}
        offsets = [0] * len(seqs)
        while any(off < len(t) for off, t in zip(offsets, tokens, strict=True)):
            batch, owners = [], []
            for j, (s, t) in enumerate(zip(seqs, tokens, strict=True)):
                if offsets[j] < len(t):
                    piece = t[offsets[j] : offsets[j] + (chunk_size or len(t))]
                    batch.append(PrefillChunk(piece, self.cached[s], self.tables[s]))
                    owners.append(j)
                    offsets[j] += len(piece)
                    self.cached[s] += len(piece)
            for j, row in zip(owners, self.runner.prefill(batch), strict=True):
                last[j] = row
        return torch.stack([last[j] for j in range(len(seqs))])

    def decode(self, seqs: list[int], token_ids: list[int]) -> torch.Tensor:
        items = [DecodeItem(t, self.cached[s], self.tables[s]) for s, t in zip(seqs, token_ids, strict=True)]
        for s in seqs:
            self.cached[s] += 1
        return self.runner.decode(items)

    def generate(self, seqs: list[int], logits: torch.Tensor, max_new: int) -> list[list[int]]:
        """Greedy tokens for ``seqs`` starting from their last logits; all sequences decode as one batch."""
        out = [[t] for t in logits.argmax(-1).tolist()]
        for _ in range(max_new - 1):
            nxt = self.decode(seqs, [o[-1] for o in out]).argmax(-1).tolist()
            for o, t in zip(out, nxt, strict=True):
                o.append(t)
        return out


def greedy_generate(runner: ModelRunner, prompts: list[list[int]], max_new: int,
                    chunk_size: int | None = None) -> list[list[int]]:
    """Greedy generation of ``max_new`` tokens for every prompt, batched (the tests' offline generator)."""
    driver = GreedyDriver(runner, len(prompts))
    seqs = list(range(len(prompts)))
    return driver.generate(seqs, driver.prefill(seqs, prompts, chunk_size), max_new)


def fused_runs_here() -> bool:
    """Whether the fused CPU decode step runs here (FBGEMM's fp16 packing, a C compiler, AVX2 + FMA + F16C)."""
    if not fp16_packing_available() or build.compiler() is None:
        return False
    kernel = cpu_kernel.load()
    return kernel is not None and bool(kernel.library.fused_decode_available())


def random_bf16_qwen2(path: Path, seed: int, scale: float, **sizes: int) -> Path:
    """A Qwen2 of ``COMMON`` with ``sizes`` changed, random weights (norms near 1, the rest ``scale``-wide),
    saved in bf16 at ``path``."""
    config = transformers.Qwen2Config(**{**COMMON, **sizes})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else scale * torch.randn_like(p))
    return save_checkpoint(model.to(torch.bfloat16), path)
