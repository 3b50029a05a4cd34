"""``green-ctx`` backend: CUDA Green Contexts through the driver API (``cuda.bindings.driver``).

Built once at start: read the device's SM resource (count, minimum partition size, alignment),
build the ladder, then per partitioned rung make *one* split into a disjoint decode/prefill pair
→ ``cuDevResourceGenerateDesc`` → ``cuGreenCtxCreate`` → ``cuGreenCtxStreamCreate``, and check
each context's SM count with ``cuGreenCtxGetDevResource``.  The top rung is two plain streams on
the whole device.  Any failure tears down what was made and raises :class:`BackendUnavailable`
naming the call and CUresult, so detection falls back.
"""

from __future__ import annotations

import logging
from typing import Any

from agentserve.executor.partition.base import BackendUnavailable
from agentserve.executor.partition.driver import CudaCallError, call, require_symbol, version_str
from agentserve.executor.partition.ladder import (
    DEFAULT_SHARES,
    Granularity,
    build_ladder,
    granularity_from_cc,
)
from agentserve.executor.partition.streams import StreamBackend
from agentserve.executor.partition.torch_cuda import TorchCuda
from agentserve.protocol.lanes import Lane, Rung

log = logging.getLogger(__name__)

MIN_DRIVER = 12040  # green contexts appeared in CUDA 12.4
NEEDED = (
    "cuDeviceGetDevResource",
    "cuDevResourceGenerateDesc",
    "cuGreenCtxCreate",
    "cuGreenCtxGetDevResource",
    "cuGreenCtxStreamCreate",
    "cuGreenCtxDestroy",
)


class GreenCtxBackend(StreamBackend):
    name = "green-ctx"
    unit = "SMs"

    def __init__(
        self, drv: Any, cuda: TorchCuda, device_index: int = 0, shares: tuple[float, ...] = DEFAULT_SHARES
    ) -> None:
        self._drv = drv
        self._cuda = cuda
        self._raw_streams: list[Any] = []  # CUstream handles we created: destroyed first
        self._contexts: list[Any] = []  # CUgreenCtx handles: destroyed after every stream
        self._streams: dict[int, dict[Lane, Any]] = {}  # rung index → lane → torch stream
        try:
            ladder, device, note = self._build(device_index, shares)
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
        sm_type = drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM
        resource = call(drv, "cuDeviceGetDevResource", dev, sm_type)
        total = int(resource.sm.smCount)
        gran, gran_note = self._granularity(dev, resource.sm)
        planned = build_ladder(total, gran, shares)
        self._cuda.init()
        high = self._cuda.high_priority()
        ladder = []
        for rung in planned:
            if rung.partitioned:
                ladder.append(self._make_pair(dev, resource, rung, total, high))
            else:
                self._streams[rung.index] = {
                    Lane.DECODE: self._cuda.plain_stream(high),
                    Lane.PREFILL: self._cuda.plain_stream(0),
                }
                ladder.append(rung)
        raw_name = call(drv, "cuDeviceGetName", 256, dev)
        name = raw_name.split(b"\0", 1)[0].decode(errors="replace") if isinstance(raw_name, bytes) else str(raw_name)
        note = (
            f"CUDA Green Contexts (driver CUDA {version_str(version)}): {total} SMs, {gran_note}; "
            f"{len(ladder) - 1} partitioned rungs verified with cuGreenCtxGetDevResource, "
            "top rung = plain streams"
        )
        return ladder, f"cuda:{index} {name}", note

    def _granularity(self, dev: Any, sm: Any) -> tuple[Granularity, str]:
        min_size = int(getattr(sm, "minSmPartitionSize", 0) or 0)
        align = int(getattr(sm, "smCoscheduledAlignment", 0) or 0)
        if min_size and align:
            return Granularity(min_size, align, "driver"), f"min {min_size} SMs, alignment {align} (queried)"
        attr = self._drv.CUdevice_attribute
        major = int(call(self._drv, "cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
        minor = int(call(self._drv, "cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
        gran = granularity_from_cc(major, minor)
        return gran, (
            f"min {gran.min_size} SMs, alignment {gran.align} from the documented CC {major}.{minor} table "
            "(the SM resource lacks minSmPartitionSize/smCoscheduledAlignment: "
            "bindings or driver older than 13.0)"
        )

    def _split(self, resource: Any, decode_sms: int) -> tuple[Any, Any]:
        """One split: a group of ``decode_sms`` for decode, the disjoint remainder for prefill."""
        drv = self._drv
        if getattr(drv, "cuDevSmResourceSplitByCount", None) is not None:
            results, groups, remaining = call(drv, "cuDevSmResourceSplitByCount", 1, resource, 0, decode_sms)
            if int(groups) < 1:
                raise CudaCallError("cuDevSmResourceSplitByCount", f"made {groups} groups of {decode_sms} SMs")
            return results[0], remaining
        params = drv.CU_DEV_SM_RESOURCE_GROUP_PARAMS()
        params.smCount = decode_sms
        out = call(drv, "cuDevSmResourceSplit", 1, resource, 0, [params])
        return out[0][0], out[-1]

    def _make_pair(self, dev: Any, resource: Any, rung: Rung, total: int, high: int) -> Rung:
        decode_res, prefill_res = self._split(resource, rung.decode_units)
        got_d, got_p = int(decode_res.sm.smCount), int(prefill_res.sm.smCount)
        if got_d < rung.decode_units or got_p < 1 or got_d + got_p > total:
            raise CudaCallError(
                "split",
                f"gave {got_d}+{got_p} SMs for rung {rung.index} (asked {rung.decode_units}+{rung.prefill_units})",
            )
        self._streams[rung.index] = {
            Lane.DECODE: self._green_stream(dev, decode_res, got_d, high),
            Lane.PREFILL: self._green_stream(dev, prefill_res, got_p, 0),
        }
        return Rung(index=rung.index, decode_units=got_d, prefill_units=got_p, partitioned=True)

    def _green_stream(self, dev: Any, resource: Any, sms: int, priority: int) -> Any:
        drv = self._drv
        desc = call(drv, "cuDevResourceGenerateDesc", [resource], 1)
        ctx = call(drv, "cuGreenCtxCreate", desc, dev, drv.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM)
        self._contexts.append(ctx)
        got = call(drv, "cuGreenCtxGetDevResource", ctx, drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM)
        if int(got.sm.smCount) != sms:
            raise CudaCallError("cuGreenCtxGetDevResource", f"reports {got.sm.smCount} SMs, the split gave {sms}")
        flags = drv.CUstream_flags.CU_STREAM_NON_BLOCKING
        raw = call(drv, "cuGreenCtxStreamCreate", ctx, flags, priority)
        self._raw_streams.append(raw)
        return self._cuda.external_stream(raw)

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
