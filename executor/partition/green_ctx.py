"""``green-ctx`` backend: CUDA Green Contexts through the driver API (``cuda.bindings.driver``).

Built once at start, on device ``cuda.index``: make sure the device's primary context exists (green
contexts come after it), read the SM resource (count, minimum partition size, alignment), plan the
ladder, then per partitioned rung make *one* split into a disjoint decode group and prefill remainder
(:func:`~agentserve.executor.partition.sm_split.split_rung` shrinks a rung the driver cannot form, and
the real sizes it returns are the rung's sizes; rungs that come out the same size are merged) →
``cuDevResourceGenerateDesc`` → ``cuGreenCtxCreate`` → a stream, and check each context's SM count with
``cuGreenCtxGetDevResource``.  The stream comes from ``cuGreenCtxStreamCreate`` (driver >= 12.5), or,
where that is missing or refuses, from ``cuStreamCreateWithPriority`` with the context of
``cuCtxFromGreenCtx`` pushed current.  The top rung is two plain streams on the whole device.  Any
failure tears down what was made and raises, so detection falls back with the reason.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from agentserve.executor.partition.base import BackendUnavailable
from agentserve.executor.partition.driver import CudaCallError, call, require_symbol, version_str
from agentserve.executor.partition.ladder import (
    DEFAULT_SHARES,
    Granularity,
    build_ladder,
    granularity_from_cc,
)
from agentserve.executor.partition.sm_split import RungSplit, split_rung
from agentserve.executor.partition.streams import StreamBackend
from agentserve.executor.partition.torch_cuda import TorchCuda
from agentserve.protocol.lanes import Lane, Rung

log = logging.getLogger(__name__)

MIN_DRIVER = 12040  # green contexts appeared in CUDA 12.4
PREFILL_GROUP_ENV = "AGENTSERVE_GREEN_PREFILL"
NEEDED = (
    "cuDeviceGetDevResource",
    "cuDevResourceGenerateDesc",
    "cuGreenCtxCreate",
    "cuGreenCtxGetDevResource",
    "cuGreenCtxDestroy",
)
GREEN_STREAM = ("cuGreenCtxStreamCreate",)
CTX_STREAM = ("cuCtxFromGreenCtx", "cuCtxPushCurrent", "cuCtxPopCurrent", "cuStreamCreateWithPriority")


def read_granularity(drv: Any, dev: Any, sm: Any) -> tuple[Granularity, str]:
    """Legal partition sizes from the SM resource, else the documented compute-capability table; and a note."""
    min_size = int(getattr(sm, "minSmPartitionSize", 0) or 0)
    align = int(getattr(sm, "smCoscheduledAlignment", 0) or 0)
    if min_size and align:
        return Granularity(min_size, align, "driver"), f"min {min_size} SMs, alignment {align} (queried)"
    attr = drv.CUdevice_attribute
    major = int(call(drv, "cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
    minor = int(call(drv, "cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
    gran = granularity_from_cc(major, minor)
    return gran, (
        f"min {gran.min_size} SMs, alignment {gran.align} from the documented CC {major}.{minor} table "
        "(the SM resource lacks minSmPartitionSize/smCoscheduledAlignment: bindings or driver older than 13.0)"
    )


def structured_prefill(environ: Mapping[str, str] | None = None) -> bool:
    """``AGENTSERVE_GREEN_PREFILL``: ``remainder`` (default; prefill runs on what the decode group leaves) or
    ``structured`` (prefill on a structured group of its own, :func:`~.sm_split.split_rung`)."""
    value = (os.environ if environ is None else environ).get(PREFILL_GROUP_ENV, "remainder")
    if value not in ("remainder", "structured"):
        raise ValueError(f"{PREFILL_GROUP_ENV}={value!r}: use remainder or structured")
    return value == "structured"


class GreenCtxBackend(StreamBackend):
    name = "green-ctx"
    unit = "SMs"

    def __init__(self, drv: Any, cuda: TorchCuda, shares: tuple[float, ...] = DEFAULT_SHARES) -> None:
        self._drv = drv
        self._cuda = cuda
        self._raw_streams: list[Any] = []  # CUstream handles we created: destroyed first
        self._contexts: list[Any] = []  # CUgreenCtx handles: destroyed after every stream
        self._streams: dict[int, dict[Lane, Any]] = {}  # rung index → lane → torch stream
        self._stream_api = ""
        self._structured = structured_prefill()
        try:
            ladder, device, note = self._build(cuda.index, shares)
        except CudaCallError as e:
            self._destroy()
            raise BackendUnavailable(str(e)) from e
        except BaseException:
            self._destroy()
            raise
        super().__init__(ladder, device, note)

    # -- construction -------------------------------------------------------------------------

    def _build(self, index: int, shares: tuple[float, ...]) -> tuple[list[Rung], str, str]:
        drv = self._drv
        call(drv, "cuInit", 0)
        version = int(call(drv, "cuDriverGetVersion"))
        if version < MIN_DRIVER:
            raise BackendUnavailable(f"driver supports CUDA {version_str(version)}; green contexts need >= 12.4")
        dev = call(drv, "cuDeviceGet", index)
        for symbol in NEEDED:
            require_symbol(drv, symbol, version)
        self._stream_api = self._pick_stream_api(version)
        self._cuda.ensure_context()  # the primary context exists before any green context
        resource = call(drv, "cuDeviceGetDevResource", dev, drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM)
        total = int(resource.sm.smCount)
        gran, gran_note = read_granularity(drv, dev, resource.sm)
        splits, notes = self._plan(resource, total, gran, shares)
        if not splits:
            raise BackendUnavailable(f"no partitioned rung could be formed: {'; '.join(notes) or 'device too small'}")
        high = self._cuda.high_priority()
        ladder = [self._make_pair(dev, i, s, high) for i, s in enumerate(splits)]
        top = len(ladder)
        self._streams[top] = {Lane.DECODE: self._cuda.plain_stream(high), Lane.PREFILL: self._cuda.plain_stream(0)}
        ladder.append(Rung(index=top, decode_units=total, prefill_units=total, partitioned=False))
        note = (
            f"CUDA Green Contexts (driver CUDA {version_str(version)}): {total} SMs, {gran_note}; "
            f"{top} partitioned rungs, one split each, verified with cuGreenCtxGetDevResource; "
            f"streams from {self._stream_api}; top rung = plain streams"
            + (f"; prefill on a structured group on {sum(s.structured for s in splits)} of {top} rungs "
               "(AGENTSERVE_GREEN_PREFILL)" if self._structured else "")
        )
        if notes:
            note += "; " + "; ".join(notes)
        return ladder, f"cuda:{index} {self._device_name(dev)}", note

    def _pick_stream_api(self, version: int) -> str:
        try:
            for symbol in GREEN_STREAM:
                require_symbol(self._drv, symbol, version)
            return "cuGreenCtxStreamCreate"
        except CudaCallError as missing:
            try:
                for symbol in CTX_STREAM:
                    require_symbol(self._drv, symbol, version)
            except CudaCallError as e:
                raise CudaCallError("stream creation", f"impossible: {missing}; fallback: {e}") from e
            log.info("green-ctx streams through cuCtxFromGreenCtx: %s", missing)
            return "cuCtxFromGreenCtx"

    def _device_name(self, dev: Any) -> str:
        raw = call(self._drv, "cuDeviceGetName", 256, dev)
        return raw.split(b"\0", 1)[0].decode(errors="replace") if isinstance(raw, bytes) else str(raw)

    def _plan(
        self, resource: Any, total: int, gran: Granularity, shares: tuple[float, ...]
    ) -> tuple[list[RungSplit], list[str]]:
        """One split per planned rung, shrunk to what the driver forms; rungs of equal real size merged."""
        by_size: dict[int, RungSplit] = {}
        notes: list[str] = []
        for planned in build_ladder(total, gran, shares)[:-1]:
            split, note = split_rung(self._drv, resource, planned.decode_units, total, gran, self._structured)
            if split is None:
                notes.append(f"{note}; rung dropped")
            elif split.decode_sms in by_size:
                notes.append(f"{note or f'asked {split.asked} SMs'}: same as another rung, dropped")
            else:
                by_size[split.decode_sms] = split
                if note:
                    notes.append(note)
        return [by_size[d] for d in sorted(by_size)], notes

    def _make_pair(self, dev: Any, index: int, split: RungSplit, high: int) -> Rung:
        self._streams[index] = {
            Lane.DECODE: self._green_stream(dev, split.decode, split.decode_sms, high),
            Lane.PREFILL: self._green_stream(dev, split.prefill, split.prefill_sms, 0),
        }
        return Rung(index=index, decode_units=split.decode_sms, prefill_units=split.prefill_sms, partitioned=True)

    def _green_stream(self, dev: Any, resource: Any, sms: int, priority: int) -> Any:
        drv = self._drv
        desc = call(drv, "cuDevResourceGenerateDesc", [resource], 1)
        ctx = call(drv, "cuGreenCtxCreate", desc, dev, drv.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM)
        self._contexts.append(ctx)
        got = call(drv, "cuGreenCtxGetDevResource", ctx, drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM)
        if int(got.sm.smCount) != sms:
            raise CudaCallError("cuGreenCtxGetDevResource", f"reports {got.sm.smCount} SMs, the split gave {sms}")
        raw = self._raw_stream(ctx, priority)
        self._raw_streams.append(raw)
        return self._cuda.external_stream(raw)

    def _raw_stream(self, ctx: Any, priority: int) -> Any:
        drv = self._drv
        flags = drv.CUstream_flags.CU_STREAM_NON_BLOCKING
        if self._stream_api == "cuGreenCtxStreamCreate":
            try:
                return call(drv, "cuGreenCtxStreamCreate", ctx, flags, priority)
            except CudaCallError as e:
                log.warning("cuGreenCtxStreamCreate failed (%s); making streams through cuCtxFromGreenCtx", e)
                self._stream_api = "cuCtxFromGreenCtx"
        call(drv, "cuCtxPushCurrent", call(drv, "cuCtxFromGreenCtx", ctx))
        try:
            return call(drv, "cuStreamCreateWithPriority", flags, priority)
        finally:
            call(drv, "cuCtxPopCurrent")

    # -- use and teardown ---------------------------------------------------------------------

    def _release(self) -> None:
        self._destroy()

    def _destroy(self) -> None:
        """Streams first (synchronised, then destroyed), then the green contexts."""
        self._streams.clear()
        for raw in self._raw_streams:
            self._quiet("cuStreamSynchronize", raw)
            self._quiet("cuStreamDestroy", raw)
        self._raw_streams.clear()
        for ctx in self._contexts:
            self._quiet("cuGreenCtxDestroy", ctx)
        self._contexts.clear()

    def _quiet(self, fname: str, handle: Any) -> None:
        try:
            call(self._drv, fname, handle)
        except CudaCallError as e:
            log.warning("teardown: %s", e)
