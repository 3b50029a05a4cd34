"""Checked calls into ``cuda.bindings.driver`` (or a fake with the same tuple shapes).

Every binding returns ``(CUresult, value...)``; some raise instead (``cuInit`` raises
``DynamicLibNotFoundError`` where there is no driver library, a symbol the driver lacks raises
``RuntimeError``).  :func:`call` turns all of these into one :class:`CudaCallError` that names the
call and the CUresult (or the exception), which is what a fallback reason records.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any


class CudaCallError(RuntimeError):
    def __init__(self, call: str, detail: str, code: int | None = None) -> None:
        super().__init__(f"{call} {detail}")
        self.call = call
        self.code = code


def load_driver() -> ModuleType:
    """Import ``cuda.bindings.driver``; raise :class:`CudaCallError` naming what is missing."""
    try:
        from cuda.bindings import driver
    except Exception as e:  # ImportError, or a broken install raising anything
        raise CudaCallError("import cuda.bindings.driver", f"failed: {type(e).__name__}: {e}") from e
    return driver


def result_name(err: Any) -> str:
    return f"{getattr(err, 'name', 'CUresult')} ({int(err)})"


def call(drv: Any, fname: str, *args: Any) -> Any:
    """Call ``drv.fname(*args)``; return ``None``, the one value, or the tuple of values."""
    fn = getattr(drv, fname, None)
    if fn is None:
        raise CudaCallError(fname, "is missing from the installed cuda-bindings")
    try:
        out = fn(*args)
    except Exception as e:
        raise CudaCallError(fname, f"raised {type(e).__name__}: {e}") from e
    err, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
    if int(err) != 0:
        raise CudaCallError(fname, f"returned {result_name(err)}", int(err))
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def require_symbol(drv: Any, symbol: str, cuda_version: int) -> None:
    """Raise :class:`CudaCallError` when the driver does not export ``symbol`` (via cuGetProcAddress)."""
    if getattr(drv, symbol, None) is None:
        raise CudaCallError(symbol, "is missing from the installed cuda-bindings")
    flags = drv.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
    pfn, status = call(drv, "cuGetProcAddress", symbol.encode(), cuda_version, flags)
    found = drv.CUdriverProcAddressQueryResult.CU_GET_PROC_ADDRESS_SUCCESS
    if int(status) != int(found) or not int(pfn or 0):
        raise CudaCallError(
            symbol, f"is not exported by the driver (cuGetProcAddress: {getattr(status, 'name', status)})"
        )


def version_str(v: int) -> str:
    """12040 → '12.4'."""
    return f"{v // 1000}.{(v % 1000) // 10}"
