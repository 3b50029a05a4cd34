"""The compiled CPU library: ``attention/paged_decode.c`` (paged decode attention), ``fused/decode_step.c``
(the fused decode step, which calls the first), ``attention/paged_prefill.c`` (prefill attention on bf16
dot-product units, where the CPU has them), ``attention/paged_prefill_fp32.c`` (prefill attention in fp32 on
AVX2), ``attention/gather_bf16.c`` (an fp16 cache's keys and values gathered as bf16, for PyTorch's bf16 attention)
and ``partition/omp_team.c`` (re-pinning a lane thread's OpenMP workers), built once per machine with the
system C compiler into one shared object (``paged_decode.so``), then loaded through ctypes by their Python
wrappers (:class:`~agentserve.executor.attention.cpu_kernel.PagedDecodeKernel`,
:class:`~agentserve.executor.fused.step.FusedDecodeStep`,
:class:`~agentserve.executor.attention.cpu_prefill.PagedPrefillKernel`,
:class:`~agentserve.executor.attention.cpu_gather.Bf16Gather`,
:class:`~agentserve.executor.fused.prefill_qkv.PrefillQkv`, :mod:`~agentserve.executor.partition.omp_team`).

The sources are plain C (no PyTorch headers), so they build in about a second.  The shared object is cached
under ``<cache>/<hash>/``: the hash covers the sources, the compiler's version, the flags, the CPU's feature
flags (it is built with ``-march=native``) and the C library's version; ``<cache>`` is
``$AGENTSERVE_KERNEL_DIR`` or ``~/.cache/agentserve/kernels``.  A machine without a working C compiler gets
``None`` (logged once) and the PyTorch paths; nothing else changes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import TypeVar

from agentserve import configs

log = logging.getLogger(__name__)

_EXECUTOR = Path(__file__).parents[1]
SOURCES = (_EXECUTOR / "attention" / "paged_decode.c", _EXECUTOR / "fused" / "decode_step.c",
           _EXECUTOR / "fused" / "helper.c", _EXECUTOR / "attention" / "paged_prefill.c",
           _EXECUTOR / "attention" / "paged_prefill_fp32.c", _EXECUTOR / "attention" / "gather_bf16.c",
           _EXECUTOR / "fused" / "prefill_qkv.c", _EXECUTOR / "partition" / "omp_team.c")
HEADERS = (_EXECUTOR / "attention" / "paged_prefill.h", _EXECUTOR / "attention" / "simd_math.h",
           _EXECUTOR / "fused" / "helper.h", _EXECUTOR / "kernels" / "bf16_round.h")  # included: in the key
LIBRARY = "paged_decode.so"  # the file name inside its cache folder
# -ffast-math (vectorised expf, reassociated sums) only when compiling: on the link line gcc would add
# crtfastmath.o, which flushes subnormals to zero for the whole process as soon as the library loads.
COMPILE = ("-O3", "-march=native", "-ffast-math", "-fPIC", "-c")
LINK = ("-shared",)
OPENMP = "-fopenmp"  # dropped when the compiler has no OpenMP: the library then runs on one thread
# sources whose results must be bitwise PyTorch's: IEEE arithmetic, every product and sum rounded on its own
EXACT = ("-fno-fast-math", "-ffp-contract=off")
SOURCE_FLAGS = {_EXECUTOR / "fused" / "prefill_qkv.c": EXACT}
DIR_ENV = "AGENTSERVE_KERNEL_DIR"
CFLAGS_ENV = "AGENTSERVE_KERNEL_CFLAGS"  # extra compile-only flags, e.g. -mno-avx512f for the AVX2 build (tests)


def cache_dir() -> Path:
    """Where built libraries are kept: ``$AGENTSERVE_KERNEL_DIR``, else ``~/.cache/agentserve/kernels``."""
    return configs.cache_dir(DIR_ENV, "kernels")


def compiler() -> str | None:
    """The C compiler used: ``$CC``, else cc, gcc or clang; ``None`` when there is none."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")


def extra_flags() -> tuple[str, ...]:
    """``$AGENTSERVE_KERNEL_CFLAGS``, split like a shell would: flags for each compile after the built-in ones (not
    for the link; part of the cache key).  ``-mno-avx512f`` builds the AVX2 products on an AVX-512 CPU (the other
    CPU class's code).  Unbalanced quotes raise ``ValueError``."""
    return tuple(shlex.split(os.environ.get(CFLAGS_ENV, "")))


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


def _build(cc: str, flags: tuple[str, ...], out: Path) -> None:
    """Compile with the extra ``flags`` into ``out`` atomically (concurrent builders each write temporary files,
    then rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objs, lib = [Path(tmp) / f"{src.stem}.o" for src in SOURCES], Path(tmp) / LIBRARY
        for extra in ((OPENMP,), ()):
            error = next(filter(None, (_run([cc, *COMPILE, *flags, *SOURCE_FLAGS.get(src, ()), *extra, str(src),
                                             "-o", str(obj)])
                                       for src, obj in zip(SOURCES, objs, strict=True))), None)
            error = error or _run([cc, *LINK, *extra, *map(str, objs), "-o", str(lib), "-lm"])
            if error is None:
                os.replace(lib, out)
                return
        raise OSError(error)


def _open(path: Path) -> ctypes.CDLL:
    """Load the library with its OpenMP runtime's idle threads sleeping, not spinning.

    With the current PyTorch wheels for Linux the ``libgomp.so.1`` it links resolves to the one PyTorch already
    loaded: one runtime, which read its wait policy when PyTorch loaded it, so the setting here has no effect
    (:mod:`~agentserve.executor.partition.omp_team` relies on the one runtime and checks it).  Where it is a
    second runtime, with the default policy its workers would spin between layers on cores the prefill lane
    runs on; libgomp reads the policy when it is first loaded, so it is set for that moment only (an explicit
    ``OMP_WAIT_POLICY`` wins)."""
    before = os.environ.get("OMP_WAIT_POLICY")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        return ctypes.CDLL(str(path))
    finally:
        if before is None:
            del os.environ["OMP_WAIT_POLICY"]


_LOADING = threading.Lock()
_WRAPPING = threading.Lock()
T = TypeVar("T")


def library() -> ctypes.CDLL | None:
    """The library, built on first use; ``None`` (logged once) where it cannot be built or loaded."""
    with _LOADING:  # one build, one temporary change of the environment, at a time
        return _library()


def wrapped(make: Callable[..., T | None], *args: Hashable) -> T | None:
    """``make(library, *args)``: a Python wrapper of the library's functions, made once per loaded library and
    arguments (a wrapper sets its functions' argtypes: two threads loading at once get one); ``None`` where the
    library cannot be built or loaded, or ``make`` says this build lacks what it wraps."""
    lib = library()
    if lib is None:
        return None
    with _WRAPPING:
        return _wrapped(make, lib, *args)


@functools.cache
def _wrapped(make: Callable[..., T | None], lib: ctypes.CDLL, *args: Hashable) -> T | None:
    return make(lib, *args)


@functools.cache
def _library() -> ctypes.CDLL | None:
    cc = compiler()
    if cc is None:
        log.warning("no C compiler (cc, gcc or clang) found: CPU decode runs on the PyTorch path")
        return None
    try:
        flags = extra_flags()  # read once: the key and the build must agree
        key = hashlib.sha256(
            "\0".join([*(src.read_text() for src in (*SOURCES, *HEADERS)), _version(cc), *COMPILE, *flags, *LINK,
                       OPENMP, *(f"{src.name}: {' '.join(f)}" for src, f in SOURCE_FLAGS.items()), _cpu_flags(),
                       *platform.libc_ver()]).encode()
        ).hexdigest()[:16]
        path = cache_dir() / key / LIBRARY
        if not path.exists():
            log.info("building the CPU library (paged decode and prefill attention, fused decode step) with %s into %s",
                     cc, path)
            _build(cc, flags, path)
        return _open(path)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        log.warning("the CPU library is unavailable (%s): CPU decode runs on the PyTorch path", e)
        return None


def forget() -> None:
    """Drop the remembered load (tests: the next :func:`library` looks again)."""
    with _LOADING:
        _library.cache_clear()
