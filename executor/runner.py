"""ModelRunner: loads a checkpoint and runs ragged prefill and batched decode on a paged KV cache.

Block allocation belongs to the caller: every request names the blocks (``block_table``) that cover
positions ``0 ..`` its last token.  The runner writes the new tokens' K/V into those blocks and returns
fp32 logits; it never samples and never decides what runs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from agentserve.executor.attention import AttentionBatch, cpu_decode_kernel, create_backend
from agentserve.executor.attention.cpu_kernel import PagedDecodeKernel
from agentserve.executor.attention.cpu_prefill import PagedPrefillKernel
from agentserve.executor.checkpoint import ModelConfig, load_config, load_weights
from agentserve.executor.errors import EngineError, InvalidRequestError, PromptTooLongError
from agentserve.executor.fused import prefill_qkv
from agentserve.executor.fused.helper import DECODE_HELPER_SETTINGS, DecodeHelper
from agentserve.executor.fused.prefill_qkv import PrefillQkv
from agentserve.executor.fused.step import MATRICES as FUSED_MATRICES
from agentserve.executor.fused.step import FusedDecodeStep
from agentserve.executor.fused.step import why_not as fused_why_not
from agentserve.executor.kv_cache import KVCache, bytes_per_block
from agentserve.executor.linear import ALL_ROWS, Linear, bf16_rows, block_bf16_products, check_weights
from agentserve.executor.memory import CudaMemory, DeviceMemory, kv_budget_bytes, profile_memory
from agentserve.executor.model import DecoderModel
from agentserve.executor.runner_graphs import RunnerGraphs

log = logging.getLogger(__name__)

DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}
CPU_KV_FRACTION = 0.5  # share of the available RAM the KV cache takes on a CPU by default ...
CPU_KV_CAP_BYTES = 2 << 30  # ... at most (engine.toml kv_cache_fraction, kv_cache_max_gb_cpu)
BLOCKED_RAM_SHARE = 0.25  # most of the free RAM hybrid matrices' oneDNN-blocked copies may take (else none)
DEFAULT_MAX_SEQS = 64  # the default KV budget never exceeds this many full-length sequences
MEMORY_UTILIZATION = 0.90  # share of a GPU's memory the executor may hold (weights, activations, KV cache)
PROFILE_TOKENS = 8192  # the prefill chunk the CUDA memory profile runs (capped by the context length)


@dataclass
class PrefillChunk:
    """``token_ids`` of one sequence at positions ``start_pos ..``; positions ``< start_pos`` are cached."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]


@dataclass
class DecodeItem:
    """One token of one sequence fed at ``position`` (all earlier positions are cached)."""

    token_id: int
    position: int
    block_table: list[int]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineError(f"device {device!r} requested but CUDA is not available")
    return dev


def resolve_dtype(dtype: str, device: torch.device, config: ModelConfig) -> torch.dtype:
    """``auto``: the checkpoint's bf16/fp16 on CUDA (else bf16); fp32 activations on CPU — where the CPU has
    native bf16, its bf16 units still run the prefill products (``weights = auto`` makes 16-bit matrices
    hybrid, :mod:`.linear`), while decode keeps the packed fp16 products and the compiled fp32 kernel."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.float16 if config.torch_dtype == "float16" else torch.bfloat16
        return torch.float32
    if dtype not in DTYPES:
        raise EngineError(f"unknown dtype {dtype!r}; use auto, bfloat16, float16 or float32")
    if DTYPES[dtype] == torch.float16 and device.type == "cpu":
        raise EngineError(
            "float16 is not supported on CPU (its matmuls are ~100x slower); use bfloat16 or float32"
        )
    return DTYPES[dtype]


KV_DTYPES = ("auto", "float32", "float16")  # kv_cache_dtype settings (a model dtype on CUDA)


def resolve_kv_dtype(setting: str, device: torch.device, dtype: torch.dtype, weight_formats: list[str],
                     kernel_reads_f16: bool) -> torch.dtype:
    """The KV cache's element type.  ``auto``: fp16 on a CPU running fp32 activations over packed 16-bit matrices
    (a 16-bit checkpoint; llama.cpp's default cache type) where the compiled decode kernel the attention backend
    runs reads fp16 (``kernel_reads_f16``) — decode attention reads half the bytes, 1.2-1.4x faster at a few
    thousand cached tokens, K/V rounded to fp16 (11 significant bits); else the model dtype.  ``float32`` (CPU,
    fp32 activations): the exact cache."""
    if setting not in KV_DTYPES:
        raise EngineError(f"unknown kv_cache_dtype {setting!r}; use {', '.join(KV_DTYPES)}")
    cpu_fp32 = device.type == "cpu" and dtype == torch.float32
    if setting == "auto":
        packed = any(f in ("fp16", "hybrid") for f in weight_formats)
        return torch.float16 if cpu_fp32 and packed and kernel_reads_f16 else dtype
    wanted = DTYPES[setting]
    if wanted != dtype and not (cpu_fp32 and wanted == torch.float16):
        raise EngineError(f"kv_cache_dtype {setting} with {str(dtype).removeprefix('torch.')} activations on "
                          f"{device.type}: only the model dtype, or float16 on a CPU running float32")
    if wanted == torch.float16 and not kernel_reads_f16:
        log.info("fp16 KV cache without the compiled kernel: decode attention widens gathered blocks in PyTorch")
    return wanted


def _available_ram() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def prefill_rows(lens: list[int]) -> tuple[torch.Tensor | slice | None, torch.Tensor | None]:
    """For a ragged step of chunks of ``lens`` tokens: the rows of chunks longer than one token (prefill, run
    in bf16 by hybrid matrices) and the rest (one-token chunks: decodes riding in the step), as
    :func:`~agentserve.executor.linear.bf16_rows` takes them."""
    long = [n > 1 for n in lens]
    if all(long):
        return ALL_ROWS, None
    if not any(long):
        return None, None
    mask = torch.tensor([is_long for is_long, n in zip(long, lens, strict=True) for _ in range(n)])
    return mask.nonzero().squeeze(1), (~mask).nonzero().squeeze(1)


class ModelRunner(RunnerGraphs):
    """Runs one model. Not thread-safe; one caller drives it (the executor's step loop)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "auto",
        device: str = "auto",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        attention_backend: str = "auto",
        max_model_len: int | None = None,
        weights: str = "auto",
        kv_cache_dtype: str = "auto",
        cuda_graphs: str = "auto",
        decode_step: str = "auto",
        decode_helper: str = "auto",
        prefill_attention: str = "auto",
        memory_utilization: float = MEMORY_UTILIZATION,
        profile_tokens: int = PROFILE_TOKENS,
        cpu_kv_fraction: float = CPU_KV_FRACTION,
        cpu_kv_cap_bytes: int = CPU_KV_CAP_BYTES,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.config = config = load_config(model_dir)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device, config)
        check_weights(weights, self.device, self.dtype)
        self._init_graphs(cuda_graphs)
        self.block_size = block_size
        for name, share in (("gpu_memory_utilization", memory_utilization), ("kv_cache_fraction", cpu_kv_fraction)):
            if not 0 < share <= 1:
                raise EngineError(f"{name} must be in (0, 1], not {share}")
        if cpu_kv_cap_bytes <= 0:
            raise EngineError(f"kv_cache_max_gb_cpu must be > 0, not {cpu_kv_cap_bytes / 2**30:g}")
        self.memory_utilization = memory_utilization
        self.profile_tokens = profile_tokens
        self.cpu_kv_fraction, self.cpu_kv_cap_bytes = cpu_kv_fraction, cpu_kv_cap_bytes
        self.max_model_len = min(
            max_model_len or config.max_position_embeddings, config.max_position_embeddings
        )
        with torch.inference_mode():
            self.model = DecoderModel(
                config, load_weights(model_dir), self.dtype, self.device, self.max_model_len, weights
            )
        kernel, _ = cpu_decode_kernel(attention_backend, config.num_heads, config.num_kv_heads, config.head_dim,
                                      block_size, self.device, self.dtype)
        self.kv_dtype = resolve_kv_dtype(kv_cache_dtype, self.device, self.dtype, self.model.weight_formats,
                                         kernel is not None and kernel.reads_f16)
        self.attention = create_backend(
            attention_backend, config.num_heads, config.num_kv_heads, config.head_dim, block_size, self.device,
            self.dtype, self.kv_dtype, prefill_attention, "hybrid" in self.model.weight_formats,
        )
        self.fused_decode = self._fused_decode(decode_step)
        self.model.prefill_qkv = self._prefill_qkv()
        self.blocked_bytes = self._block_bf16_products()
        if decode_helper not in DECODE_HELPER_SETTINGS:
            raise EngineError(f"unknown decode_helper {decode_helper!r}; use {', '.join(DECODE_HELPER_SETTINGS)}")
        self.decode_helper = decode_helper
        self.num_blocks = num_blocks or self._default_num_blocks(kv_cache_bytes)
        self.kv_cache = self._new_cache(self.num_blocks)
        if self.device.type == "cuda":  # compile the attention kernels now, not in the first request's step
            log.info("compiling %s attention kernels", type(self.attention).__name__)
            with torch.inference_mode():
                self.attention.warmup(self.kv_cache.k[0], self.kv_cache.v[0])
        log.info(
            "loaded %s (%s) on %s as %s, %s weights; %s KV cache %d blocks x %d tokens (%.1f MiB)",
            model_dir,
            config.architecture,
            self.device,
            self.dtype,
            self.weight_format,
            str(self.kv_dtype).removeprefix("torch."),
            self.num_blocks,
            block_size,
            self.kv_cache.total_bytes / 2**20,
        )

    def _fused_decode(self, setting: str) -> FusedDecodeStep | None:
        """The fused decode step where ``setting`` allows it and it runs here; ``fused`` fails where it cannot.

        It calls the paged-decode kernel the attention backend decodes with (None: no kernel in use)."""
        kernel: PagedDecodeKernel | None = getattr(self.attention, "decode_kernel", None)
        why = fused_why_not(setting, kernel, self.device, self.dtype, self._layer_matrices())
        if why and setting == "fused":
            raise EngineError(f"decode_step 'fused' is unavailable: {why}")
        if why:
            if self.device.type == "cpu":
                log.info("decode step: PyTorch (%s)", why)
            return None
        step = FusedDecodeStep(kernel, self.model, self.block_size)
        log.info("decode step: fused C (%.1f MiB of fp16 matrices added)", step.bytes_added / 2**20)
        return step

    def _prefill_qkv(self) -> PrefillQkv | None:
        """The compiled q/k/v pass of prefill steps (:mod:`.fused.prefill_qkv`) where they can take it: hybrid or packed
        fp16 matrices on a CPU, an fp16 cache (``DecoderModel._fused_qkv_queries`` checks each step)."""
        dim = self.model.config.head_dim
        packed = {"hybrid", "fp16"} & set(self.model.weight_formats)
        if (self.device.type != "cpu" or not packed or self.kv_dtype != torch.float16 or dim % 2
                or dim > prefill_qkv.MAX_DIM):
            return None
        kernel = prefill_qkv.load()
        log.info("prefill q/k/v: %s", "one compiled pass" if kernel
                 else "PyTorch's passes (the CPU library is unavailable or has no F16C)")
        return kernel

    def _layer_matrices(self) -> list[Linear]:
        return [getattr(layer, name) for layer in self.model.layers for name in FUSED_MATRICES]

    def _block_bf16_products(self) -> int:
        """oneDNN-blocked copies of the layers' hybrid matrices for prefill products while they take at most
        :data:`BLOCKED_RAM_SHARE` of the memory still free (:func:`.linear.block_bf16_products`).  Not the head's: a
        prefill's logits are taken after its bf16 rows (the packed product).  Made before the KV cache is sized, which
        on a CPU takes a share of the memory then free."""
        if "hybrid" not in self.model.weight_formats:
            return 0
        added = block_bf16_products(self._layer_matrices(), int(_available_ram() * BLOCKED_RAM_SHARE))
        log.info("bf16 prefill products: %s", f"oneDNN-blocked copies ({added / 2**20:.1f} MiB added)" if added
                 else "F.linear (no blocked copies: no native bf16 or oneDNN's bf16, or they would take over "
                      f"{BLOCKED_RAM_SHARE:.0%} of the free memory)")
        return added

    def new_decode_helper(self) -> DecodeHelper | None:
        """A decode helper (:mod:`.fused.helper`, not started) for the fused step; ``None`` without the fused step or
        with ``decode_helper = "off"``."""
        if self.fused_decode is None or self.decode_helper == "off":
            return None
        return self.fused_decode.helper()

    def _new_cache(self, num_blocks: int) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, num_blocks, self.block_size, c.num_kv_heads, c.head_dim, self.kv_dtype,
                       self.device)

    @property
    def _per_block(self) -> int:
        c = self.config
        return bytes_per_block(c.num_layers, self.block_size, c.num_kv_heads, c.head_dim, self.kv_dtype)

    @property
    def _full_blocks(self) -> int:
        """Blocks for ``DEFAULT_MAX_SEQS`` sequences of full length: the default never exceeds it."""
        return DEFAULT_MAX_SEQS * -(-self.max_model_len // self.block_size)

    def _default_num_blocks(self, budget: int | None) -> int:
        per_block = self._per_block
        if budget is None and self.device.type == "cuda":
            return self.profiled_num_blocks(CudaMemory(self.device), self.memory_utilization)
        if budget is None:
            budget = min(int(_available_ram() * self.cpu_kv_fraction), self.cpu_kv_cap_bytes)
            return max(1, min(budget // per_block, self._full_blocks))
        if budget < per_block:
            raise EngineError(f"KV cache budget {budget} bytes is smaller than one block ({per_block} bytes)")
        return budget // per_block

    def profiled_num_blocks(self, memory: DeviceMemory, utilization: float) -> int:
        """KV blocks that fit in ``utilization`` of the device after the weights and a profiling step."""
        profile = profile_memory(memory, lambda: self.profile_step(self.profile_tokens))
        budget = kv_budget_bytes(profile, utilization) - self.graph_reserve_bytes()  # decode graphs' pool
        log.info(
            "memory profile: %.2f GiB total, %.2f GiB held outside torch, %.2f GiB weights and buffers, "
            "%.2f GiB activation peak -> %.2f GiB for the KV cache at %.0f%% utilization",
            *(x / 2**30 for x in (profile.total, profile.total - profile.free - profile.reserved,
                                  profile.allocated, profile.peak, max(budget, 0))), utilization * 100,
        )
        if budget < self._per_block:
            raise EngineError(
                f"no memory left for the KV cache: {utilization:.0%} of {profile.total / 2**30:.1f} GiB less "
                f"{profile.allocated / 2**30:.1f} GiB weights and a {profile.peak / 2**30:.1f} GiB activation peak "
                "leaves less than one block; raise memory_utilization or lower profile_tokens"
            )
        return max(1, min(budget // self._per_block, self._full_blocks))

    @torch.inference_mode()
    def profile_step(self, tokens: int) -> None:
        """One prefill chunk of ``tokens`` and one decode batch of ``DEFAULT_MAX_SEQS`` on a scratch cache.

        The runner's own cache (if any) is put back untouched."""
        n = max(1, min(tokens, self.max_model_len))
        bs, vocab = self.block_size, self.config.vocab_size
        chunk_blocks = -(-n // bs)
        saved = getattr(self, "kv_cache", None), getattr(self, "num_blocks", 0)
        self.num_blocks = chunk_blocks + DEFAULT_MAX_SEQS
        self.kv_cache = self._new_cache(self.num_blocks)
        try:
            self.prefill([PrefillChunk([i % vocab for i in range(n)], 0, list(range(chunk_blocks)))])
            self.decode([DecodeItem(1 % vocab, 0, [chunk_blocks + i]) for i in range(DEFAULT_MAX_SEQS)])
        finally:
            self.kv_cache, self.num_blocks = saved

    @torch.inference_mode()
    def warm_up(self) -> None:
        """A three-token prefill and a one-token decode in block 0 of the cache, which is then zeroed again.

        Run once per (rung, lane) before serving: every green context loads the kernels of a step (CUDA
        loads modules per context on first launch), so the first real step on a rung is not the slow one.
        Only at start-up, when no sequence owns a block."""
        n = 3
        table = list(range(-(-(n + 1) // self.block_size)))
        vocab = self.config.vocab_size
        try:
            self.prefill([PrefillChunk([i % vocab for i in range(1, n + 1)], 0, table)])
            self.decode([DecodeItem((n + 1) % vocab, n, table)])
        finally:
            for layer in (*self.kv_cache.k, *self.kv_cache.v):
                layer[table].zero_()

    @property
    def prefill_kernel(self) -> PagedPrefillKernel | None:
        """The compiled prefill-attention kernel (bf16 or fp32) the attention backend runs, or None."""
        return getattr(self.attention, "prefill_kernel", None)

    @property
    def prefill_attention(self) -> str | None:
        """How prefill chunks are attended where it is not PyTorch's flash attention in the model's dtype: ``bf16`` or
        ``fp32`` (the compiled kernels), ``torch-bf16`` (PyTorch on bf16 copies); else None."""
        if self.prefill_kernel is not None:
            return self.prefill_kernel.variant
        return "torch-bf16" if getattr(self.attention, "prefill_dtype", None) == torch.bfloat16 else None

    @property
    def weight_format(self) -> str:
        """``dense``, ``fp16`` (packed for FBGEMM) or ``dense+fp16`` when the matrices differ."""
        return "+".join(self.model.weight_formats)

    @property
    def capacity_tokens(self) -> int:
        return self.kv_cache.capacity_tokens

    @property
    def bytes_per_block(self) -> int:
        return self.kv_cache.bytes_per_block

    @torch.inference_mode()
    def prefill(
        self, chunks: list[PrefillChunk], all_logits: bool = False
    ) -> torch.Tensor | list[torch.Tensor]:
        """Run chunks of several sequences at once. Returns fp32 logits of each chunk's last token
        (``[len(chunks), vocab]``), or with ``all_logits`` a list of ``[len(chunk), vocab]``."""
        if not chunks:
            raise InvalidRequestError("prefill needs at least one chunk")
        for c in chunks:
            self._check(c.token_ids, c.start_pos, c.block_table)
        lens = [len(c.token_ids) for c in chunks]
        ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64)
        positions = torch.cat(
            [torch.arange(c.start_pos, c.start_pos + n) for c, n in zip(chunks, lens, strict=True)]
        )
        slots = torch.cat(
            [self._slots(c.block_table, c.start_pos, n) for c, n in zip(chunks, lens, strict=True)]
        )
        batch = AttentionBatch(
            False, lens, [c.start_pos for c in chunks], [c.block_table for c in chunks], slots
        )
        hybrid = "hybrid" in self.model.weight_formats  # the only matrices (and attention) that read the rows
        last = None if all_logits else (torch.tensor(lens).cumsum(0) - 1).to(self.device)
        with bf16_rows(*(prefill_rows(lens) if hybrid else (None, None))):
            hidden = self._forward(ids, positions, batch, last)
        if all_logits:
            return list(self.model.logits(hidden).split(lens))
        return self.model.logits(hidden)

    @torch.inference_mode()
    def decode(self, items: list[DecodeItem], rung: int | None = None,
               helper: DecodeHelper | None = None) -> torch.Tensor:
        """One token for each sequence; returns fp32 logits ``[len(items), vocab]``.

        With ``rung``, replays that rung's decode graph where one fits (its logits are overwritten by the
        next replay: read them before the next step).  ``helper`` shares a fused one-thread step
        (:mod:`.fused.helper`)."""
        if not items:
            raise InvalidRequestError("decode needs at least one item")
        bs = self.block_size
        for it in items:
            self._check([it.token_id], it.position, it.block_table)
        replayed = self._replay_decode(rung, [it.token_id for it in items], [it.position for it in items],
                                       [it.block_table for it in items])
        if replayed is not None:
            return replayed
        ids = torch.tensor([it.token_id for it in items], dtype=torch.int64)
        positions = torch.tensor([it.position for it in items], dtype=torch.int64)
        slots = torch.tensor(
            [it.block_table[it.position // bs] * bs + it.position % bs for it in items], dtype=torch.int64
        )
        batch = AttentionBatch(
            True, [1] * len(items), [it.position for it in items], [it.block_table for it in items], slots
        )
        if self.fused_decode is not None:
            meta = self.attention.plan(batch)
            hidden = self.fused_decode(ids, positions, meta.slots, meta.block_tables, meta.lens, self.kv_cache,
                                       torch.get_num_threads(), helper)
            return self.model.logits(hidden)
        return self.model.logits(self._forward(ids, positions, batch))

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
        meta = self.attention.plan(batch)
        ids, positions = ids.to(self.device, non_blocking=True), positions.to(self.device, non_blocking=True)
        return self.model.forward(ids, positions, self.kv_cache, self.attention, meta, rows)

    def _slots(self, table: list[int], start: int, n: int) -> torch.Tensor:
        pos = torch.arange(start, start + n)
        blocks = torch.tensor(table[: -(-(start + n) // self.block_size)], dtype=torch.int64)
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def _check(self, token_ids: list[int], start: int, table: list[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("empty token list")
        if start < 0:
            raise InvalidRequestError(f"negative start position {start}")
        end = start + len(token_ids)
        if end > self.max_model_len:
            raise PromptTooLongError(
                f"sequence of {end} tokens exceeds the model's context of {self.max_model_len}"
            )
        lo, hi = min(token_ids), max(token_ids)
        if lo < 0 or hi >= self.config.vocab_size:
            raise InvalidRequestError(
                f"token id {lo if lo < 0 else hi} outside vocabulary [0, {self.config.vocab_size})"
            )
        need = -(-end // self.block_size)
        if len(table) < need:
            raise InvalidRequestError(f"block table has {len(table)} blocks, {end} tokens need {need}")
        used = table[:need]
        if min(used) < 0 or max(used) >= self.num_blocks:
            raise InvalidRequestError(f"block id outside the KV cache [0, {self.num_blocks})")
