"""The CPU paged-decode kernel (``paged_decode.c``): built once per machine with the system C compiler, then
loaded through ctypes.  The same library holds the fused decode step (``executor/fused/decode_step.c``), which
calls the kernel for its attention.

PyTorch's decode path must first gather each sequence's blocks into a contiguous copy, and no installable
library attends a paged cache in place on an AVX2 CPU (Intel's extension is pinned to particular PyTorch
releases and being retired, vLLM's CPU kernels are not a separate library, SGLang's target AVX-512 Xeons).
The kernel is plain C (no PyTorch headers), so it builds in about a second.  The shared object is cached
under ``<cache>/<hash>/``: the hash covers the source, the compiler's version, the flags, the CPU's
feature flags (it is built with ``-march=native``) and the C library's version; ``<cache>`` is
``$AGENTSERVE_KERNEL_DIR`` or ``~/.cache/agentserve/kernels``.
A machine without a working C compiler gets ``None`` and the PyTorch path; nothing else changes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from agentserve import configs

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
SOURCES = (SOURCE, Path(__file__).parents[1] / "fused" / "decode_step.c")  # compiled into one library
# -ffast-math (vectorised expf, reassociated sums) only when compiling: on the link line gcc would add
# crtfastmath.o, which flushes subnormals to zero for the whole process as soon as the library loads.
COMPILE = ("-O3", "-march=native", "-ffast-math", "-fPIC", "-c")
LINK = ("-shared",)
OPENMP = "-fopenmp"  # dropped when the compiler has no OpenMP: the kernel then runs on one thread
DIR_ENV = "AGENTSERVE_KERNEL_DIR"


def cache_dir() -> Path:
    """Where built kernels are kept: ``$AGENTSERVE_KERNEL_DIR``, else ``~/.cache/agentserve/kernels``."""
    return configs.cache_dir(DIR_ENV, "kernels")


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(cc: str) -> str:
    return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout


def _run(cmd: list[str]) -> str | None:
    """The compiler's complaint, or None when ``cmd`` succeeded."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return None if done.returncode == 0 else f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}"


def _build(cc: str, out: Path) -> None:
    """Compile into ``out`` atomically (concurrent builders each write temporary files, then rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objs, lib = [Path(tmp) / f"{src.stem}.o" for src in SOURCES], Path(tmp) / "paged_decode.so"
        for extra in ((OPENMP,), ()):
            error = next(filter(None, (_run([cc, *COMPILE, *extra, str(src), "-o", str(obj)])
                                       for src, obj in zip(SOURCES, objs, strict=True))), None)
            error = error or _run([cc, *LINK, *extra, *map(str, objs), "-o", str(lib), "-lm"])
            if error is None:
                os.replace(lib, out)
                return
        raise OSError(error)


def _open(path: Path) -> ctypes.CDLL:
    """Load the library with its OpenMP runtime's idle threads sleeping, not spinning.

    The libgomp it links is usually a second OpenMP runtime beside the one PyTorch's wheel bundles; with
    the default policy its workers would spin between layers on cores the prefill lane runs on.  libgomp
    reads the policy when it is first loaded, so it is set for that moment only (an explicit
    ``OMP_WAIT_POLICY`` wins)."""
    before = os.environ.get("OMP_WAIT_POLICY")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        return ctypes.CDLL(str(path))
    finally:
        if before is None:
            del os.environ["OMP_WAIT_POLICY"]


class PagedDecodeKernel:
    """``paged_decode_f32`` / ``paged_decode_f16`` with typed arguments; tensors must be contiguous and on the CPU.

    The query and the output are fp32; the caches fp32, or fp16 where the build reads them (:attr:`reads_f16`:
    the CPU has F16C)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library  # also holds the fused decode step (:mod:`agentserve.executor.fused`)
        ptr, i32 = ctypes.c_void_p, ctypes.c_int
        self._fns = {}
        for dtype, name in ((torch.float32, "paged_decode_f32"), (torch.float16, "paged_decode_f16")):
            fn = getattr(library, name)
            fn.argtypes = [ptr] * 3 + [ctypes.c_int64] + [ptr] * 3 + [i32] * 6 + [ctypes.c_float, i32]
            fn.restype = i32
            self._fns[dtype] = fn
        self._supports = library.paged_decode_supports
        self._supports.argtypes, self._supports.restype = [i32] * 4, i32
        has_f16 = library.paged_decode_has_f16
        has_f16.argtypes, has_f16.restype = [], i32
        self.reads_f16 = bool(has_f16())
        self.cache_dtypes = (torch.float32, torch.float16) if self.reads_f16 else (torch.float32,)

    def supports(self, heads: int, kv_heads: int, dim: int, block_size: int) -> bool:
        """Whether the kernel takes this model shape (it has fixed limits on heads, dim and block size)."""
        return bool(self._supports(heads, kv_heads, dim, block_size))

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, scale: float, threads: int = 1) -> torch.Tensor:
        """Attention of ``q`` [B, heads, D] (one new token per sequence) over each sequence's first
        ``lens[b]`` cached tokens, found through ``tables`` [B, width] in the caches [blocks, bs, kv_heads, D]."""
        b, heads, dim = q.shape
        if (v_cache.shape != k_cache.shape or k_cache.shape[3] != dim or tables.dim() != 2 or tables.shape[0] != b
                or lens.shape != (b,)):
            raise ValueError(f"paged decode kernel: mismatched shapes q {tuple(q.shape)}, caches "
                             f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}, tables {tuple(tables.shape)}, "
                             f"lens {tuple(lens.shape)}")
        cache = k_cache.dtype if k_cache.dtype in self.cache_dtypes else torch.float32
        for t, dtype in ((q, torch.float32), (k_cache, cache), (v_cache, cache), (tables, torch.int64),
                         (lens, torch.int64)):
            if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"paged decode kernel needs contiguous CPU {dtype} tensors "
                                 f"(caches: one of {[str(d) for d in self.cache_dtypes]})")
        return self.run(q, k_cache, v_cache, tables, lens, scale, threads)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
            lens: torch.Tensor, scale: float, threads: int) -> torch.Tensor:
        """As calling the kernel, without the Python checks of shapes, dtypes and layout: for a caller whose
        tensors are right by construction (the attention backend, once per layer).  The C side still refuses
        lengths and block ids outside the cache."""
        b, heads, dim = q.shape
        num_blocks, block_size, kv_heads, _ = k_cache.shape
        out = torch.empty_like(q)
        fn = self._fns[k_cache.dtype]
        rc = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), num_blocks, tables.data_ptr(), lens.data_ptr(),
                out.data_ptr(), b, heads, kv_heads, dim, block_size, tables.shape[1], scale, threads)
        if rc == -1:
            raise ValueError(f"paged decode kernel does not take heads={heads} kv_heads={kv_heads} dim={dim} "
                             f"block_size={block_size} (check supports() first)")
        if rc == -4:
            raise ValueError("this build of the paged decode kernel does not read fp16 caches (no F16C)")
        if rc == -3:
            raise MemoryError("paged decode kernel: no memory for its softmax state")
        if rc != 0:
            raise ValueError(f"paged decode kernel: a length outside 1..{tables.shape[1] * block_size} or a block "
                             f"id outside [0, {num_blocks})")
        return out


_LOADING = threading.Lock()


def load() -> PagedDecodeKernel | None:
    """The kernel, built on first use; ``None`` (logged once) where it cannot be built or loaded."""
    with _LOADING:  # one build, one temporary change of the environment, at a time
        return _load()


@functools.cache
def _load() -> PagedDecodeKernel | None:
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler (cc, gcc or clang) found: CPU decode attention uses the PyTorch path")
        return None
    try:
        key = hashlib.sha256(
            "\0".join([*(src.read_text() for src in SOURCES), _version(cc), *COMPILE, *LINK, OPENMP, _cpu_flags(),
                       *platform.libc_ver()]).encode()
        ).hexdigest()[:16]
        path = cache_dir() / key / "paged_decode.so"
        if not path.exists():
            log.info("building the CPU paged-decode kernel with %s into %s", cc, path)
            _build(cc, path)
        return PagedDecodeKernel(_open(path))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("CPU paged-decode kernel unavailable (%s): decode attention uses the PyTorch path", e)
        return None
