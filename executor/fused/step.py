"""The fused CPU decode step (``decode_step.c``): a decode batch's whole forward pass, every layer and the final
norm, in one call into the compiled library that also holds the paged-decode kernel.

Eager PyTorch spends about as long dispatching a decode step's ~35 small operations per layer as the products
themselves take on a model that fits a CPU; the C step runs them as plain loops.  It reads each matrix as the
checkpoint's 16-bit values, row-major, from one huge-page arena (:mod:`.arena`): a hybrid matrix's bf16
copy where that is what the checkpoint stored (moved there: the matrix's ``weight16`` becomes its view into
the arena, so prefill reads it there too, and no memory is added), else the packed fp16 matrix unpacked
once into fp16 (exact: the packed values are fp16), which costs a second copy of that matrix.  Activations
and sums are fp32, as in the packed product, so its logits differ from the PyTorch path only by the order of
additions.

Used for decode-only batches on a float32 CPU model whose every matrix is packed (``fp16`` or ``hybrid``);
``decode_step = "torch"`` (engine setting) turns it off, ``"fused"`` fails start-up where it cannot run.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterable

import torch

from agentserve.executor.attention.cpu_kernel import PagedDecodeKernel
from agentserve.executor.errors import EngineError
from agentserve.executor.fused.arena import HugePageArena, aligned
from agentserve.executor.fused.helper import MAX_BATCH, DecodeHelper
from agentserve.executor.kv_cache import KVCache
from agentserve.executor.linear import HybridLinear, Linear, PackedFp16Linear

log = logging.getLogger(__name__)

DECODE_STEP_SETTINGS = ("auto", "fused", "torch")
_ptr, _i32, _i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


class _Mat(ctypes.Structure):
    _fields_ = [("w", _ptr), ("bias", _ptr), ("rows", _i64), ("cols", _i64), ("bf16", _i32)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("q_norm", _ptr), ("k_norm", _ptr), ("qkv", _Mat),
                ("o", _Mat), ("gate_up", _Mat), ("down", _Mat), ("k_cache", _ptr), ("v_cache", _ptr)]


class _Model(ctypes.Structure):
    _fields_ = [("hidden", _i32), ("heads", _i32), ("kv_heads", _i32), ("dim", _i32), ("inter", _i32),
                ("num_layers", _i32), ("block_size", _i32), ("cache_f16", _i32), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("num_blocks", _i64), ("max_positions", _i64), ("cos", _ptr),
                ("sin", _ptr), ("final_norm", _ptr), ("layers", ctypes.POINTER(_Layer))]


def rows16(linear: Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A packed matrix as 16-bit row-major values and its fp32 bias (see the module's docstring)."""
    if isinstance(linear, HybridLinear) and linear.stored == torch.bfloat16:
        return linear.weight16, linear.bias
    weight, bias = torch.ops.quantized.linear_unpack_fp16(_packed(linear).packed)
    return weight.to(torch.float16), None if bias is None else bias.float().contiguous()


def _packed(linear: Linear) -> PackedFp16Linear:
    """The packed fp16 matrix of a packed or hybrid matrix."""
    packed = linear.packed if isinstance(linear, HybridLinear) else linear
    if not isinstance(packed, PackedFp16Linear):
        raise EngineError(f"the fused decode step needs packed matrices, not {type(linear).__name__}")
    return packed


MATRICES = ("qkv", "o", "gate_up", "down")  # a layer's matrices, in the order of the C struct's fields


def why_not(setting: str, kernel: PagedDecodeKernel | None, device: torch.device, dtype: torch.dtype,
            linears: Iterable[Linear]) -> str:
    """Why the fused step cannot run for this engine, or ``""`` when it can."""
    if setting not in DECODE_STEP_SETTINGS:
        raise EngineError(f"unknown decode_step {setting!r}; use {', '.join(DECODE_STEP_SETTINGS)}")
    if setting == "torch":
        return "decode_step = torch"
    if device.type != "cpu" or dtype != torch.float32:
        return "it needs a float32 model on the CPU"
    if kernel is None:
        return "the compiled paged-decode kernel is not in use"
    if not kernel.library.fused_decode_available():
        return "this CPU or compiler lacks AVX2, FMA or F16C"
    if not all(isinstance(x, PackedFp16Linear | HybridLinear) for x in linears):
        return "some matrices are dense (weights = dense, or values beyond fp16's range)"
    return ""


def instruction_set(kernel: PagedDecodeKernel) -> str:
    """The vector instructions this build's fused products use: ``AVX-512``, ``AVX2`` or ``""`` (no fused step)."""
    return {16: "AVX-512", 8: "AVX2"}.get(int(kernel.library.fused_decode_lanes()), "")


class FusedDecodeStep:
    """Runs decode batches through ``fused_decode``; holds the 16-bit matrices and the C structs pointing at them.

    The structs point into tensors this object keeps alive; the cache pointers are refreshed whenever a
    different cache is passed (the runner swaps in a scratch cache while it profiles memory, before the lanes
    start).  Each call has its own scratch memory, so the two lanes may both run decode batches."""

    def __init__(self, kernel: PagedDecodeKernel, model, block_size: int) -> None:
        c = model.config
        self._fn = kernel.library.fused_decode
        self._library = kernel.library
        self._fn.argtypes = [ctypes.POINTER(_Model)] + [_ptr] * 6 + [_i32, _i32, _ptr, _i32, _ptr]
        self._fn.restype = _i32
        scratch = kernel.library.fused_decode_scratch
        scratch.argtypes, scratch.restype = [ctypes.POINTER(_Model), _i32], _i64
        self._scratch_floats = scratch
        self._keep: list[torch.Tensor] = []  # every tensor a struct points into
        matrices = [getattr(layer, name) for layer in model.layers for name in MATRICES]
        self.arena = HugePageArena(sum(aligned(2 * rows * cols) for rows, cols in (_packed(m).shape for m in matrices)))
        self.bytes_added = 0  # matrices copied (fp16 unpacked), not moved, into the arena
        self._layers = (_Layer * c.num_layers)(*(self._layer(layer) for layer in model.layers))
        self._model = _Model(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.num_layers, block_size,
            0, c.rms_norm_eps, c.head_dim ** -0.5, 0, model.rotary.cos.shape[0],
            self._p(model.rotary.cos), self._p(model.rotary.sin), self._p(model.norm), self._layers)
        self._embed, self._dtype = model.embed, model.dtype
        self._cache: KVCache | None = None

    def _p(self, t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        if not t.is_contiguous() or t.device.type != "cpu":
            raise EngineError("the fused decode step needs contiguous CPU tensors")
        self._keep.append(t)
        return t.data_ptr()

    def _mat(self, linear: Linear) -> _Mat:
        w, bias = rows16(linear)
        view = self.arena.put(w)
        if isinstance(linear, HybridLinear) and w is linear.weight16:
            linear.weight16 = view  # moved: the loaded copy is freed
        else:
            self.bytes_added += view.nbytes
        return _Mat(self._p(view), self._p(bias), view.shape[0], view.shape[1], int(view.dtype == torch.bfloat16))

    def _layer(self, layer) -> _Layer:
        return _Layer(self._p(layer.input_norm), self._p(layer.post_norm), self._p(layer.q_norm),
                      self._p(layer.k_norm), *(self._mat(getattr(layer, name)) for name in MATRICES), None, None)

    def _bind(self, cache: KVCache) -> None:
        if cache is self._cache:
            return
        for i, layer in enumerate(self._layers):
            layer.k_cache, layer.v_cache = cache.k[i].data_ptr(), cache.v[i].data_ptr()
        self._model.cache_f16 = int(cache.k[0].dtype == torch.float16)
        self._model.num_blocks = cache.k[0].shape[0]
        self._cache = cache

    def helper(self, max_batch: int = MAX_BATCH) -> DecodeHelper:
        """A decode helper (not started) for one-thread steps of up to ``max_batch`` sequences of this model."""
        m, chunk = self._model, self._library.fused_helper_chunk_floats
        chunk.argtypes, chunk.restype = [ctypes.POINTER(_Model), _i32], _i64
        width = -(-m.max_positions // m.block_size)
        return DecodeHelper(self._library, max_batch, width, self._scratch_floats(ctypes.byref(m), max_batch),
                            chunk(ctypes.byref(m), max_batch), owner=self)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, cache: KVCache, threads: int, helper: DecodeHelper | None = None) -> torch.Tensor:
        """Final-normed hidden states ``[B, hidden]`` of one token per sequence; writes their K/V into ``cache``.

        ``tables`` [B, width] and ``lens`` [B] (the new token counted) as the paged-decode kernel takes them;
        ``positions`` and ``slots`` [B] int64.  ``helper`` shares a one-thread step of up to its ``max_batch``
        sequences while its owner allows it; the result is bitwise the same."""
        self._bind(cache)
        b = ids.shape[0]
        x = self._embed.index_select(0, ids).to(self._dtype)
        out = torch.empty_like(x)
        scratch = torch.empty(self._scratch_floats(ctypes.byref(self._model), b))  # per call: lanes may share
        rc = self._fn(ctypes.byref(self._model), x.data_ptr(), out.data_ptr(), positions.data_ptr(),
                      slots.data_ptr(), tables.data_ptr(), lens.data_ptr(), tables.shape[1], b, scratch.data_ptr(),
                      threads, None if helper is None else helper.handle)
        if rc != 0:
            raise EngineError(f"fused decode step failed ({rc}): a position, slot, length or block id outside "
                              "the model or cache" if rc == -2 else f"fused decode step failed ({rc})")
        return out
