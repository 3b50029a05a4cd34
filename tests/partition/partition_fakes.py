"""A fake ``cuda.bindings.driver`` (same tuple shapes) and a fake torch.cuda seam, for the GPU backends.

The fake driver models what the real one does for green contexts: the SM resource reports its
count, minimum partition size and alignment; ``cuDevSmResourceSplitByCount`` rounds the group up to
a legal size and returns the rest as the remainder; green contexts own the SMs of their descriptor.
It logs every call and records *violations*: a stream destroyed after its context, a context
destroyed while it still has streams, a stream destroyed while a lane is using it.
"""

from __future__ import annotations

import enum
import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_NOT_SUPPORTED = 801
    CUDA_ERROR_INVALID_RESOURCE_TYPE = 914
    CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION = 915


class ProcStatus(enum.IntEnum):
    CU_GET_PROC_ADDRESS_SUCCESS = 0
    CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1
    CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2


# What the driver reports in the SM resource (CUDA driver API, CUdevSmResource and the split notes):
# CC 8.x: minimum 4 SMs, steps of 2; CC 9.0 and newer (incl. 12.x consumer Blackwell): 8 and 8.
GRANULARITY = {8: (4, 2), 9: (8, 8), 12: (8, 8)}


@dataclass
class SmResource:
    smCount: int
    minSmPartitionSize: int = 0
    smCoscheduledAlignment: int = 0


@dataclass
class Resource:
    sm: SmResource
    type: int = 1


class OldSm:
    """An SM resource from bindings older than 13.0: only ``smCount``."""

    def __init__(self, count: int) -> None:
        self.smCount = count


@dataclass(eq=False)
class Handle:
    kind: str
    id: int
    sms: int = 0
    ctx: Handle | None = None

    def __int__(self) -> int:
        return 0x1000 + self.id


class FakeStream:
    def __init__(self, kind: str, handle: Any = None, priority: int = 0) -> None:
        self.kind, self.handle, self.priority = kind, handle, priority
        self.synced = 0

        self.recorded: list[FakeEvent] = []
        self.waited: list[FakeEvent] = []

    def synchronize(self) -> None:
        self.synced += 1

    def record_event(self) -> FakeEvent:
        event = FakeEvent(self)
        self.recorded.append(event)
        return event

    def wait_event(self, event: FakeEvent) -> None:
        self.waited.append(event)


@dataclass(eq=False)
class FakeEvent:
    stream: FakeStream
    synced: int = 0

    def synchronize(self) -> None:
        self.synced += 1


class FakeCuda:
    """Stands in for :class:`TorchCuda`; counts which stream each thread is using."""

    def __init__(self, sms: int = 132, available: bool = True) -> None:
        self.index = 0
        self.sms = sms
        self.available = available
        self.using: Counter[int] = Counter()  # handle id → lanes inside use()
        self._lock = threading.Lock()
        self._local = threading.local()

    def unavailable_reason(self) -> str | None:
        return None if self.available else "fake: no CUDA device"

    def init(self) -> None:
        pass

    def device_name(self) -> str:
        return "Fake GPU"

    def sm_count(self) -> int:
        return self.sms

    def high_priority(self) -> int:
        return -5

    def plain_stream(self, priority: int = 0) -> FakeStream:
        return FakeStream("plain", priority=priority)

    def external_stream(self, handle: Any) -> FakeStream:
        return FakeStream("external", handle)

    def current(self) -> FakeStream | None:
        return getattr(self._local, "stream", None)

    @contextmanager
    def use(self, stream: FakeStream):
        key = int(stream.handle) if stream.handle is not None else -id(stream)
        with self._lock:
            self.using[key] += 1
        prev, self._local.stream = self.current(), stream
        try:
            yield stream
        finally:
            self._local.stream = prev
            with self._lock:
                self.using[key] -= 1

    def synchronize(self, stream: FakeStream) -> None:
        stream.synchronize()


class GroupParams:
    """CU_DEV_SM_RESOURCE_GROUP_PARAMS: zero-initialised, the caller sets ``smCount``."""

    def __init__(self) -> None:
        self.smCount = 0
        self.coscheduledSmCount = 0
        self.flags = 0


class FakeDriver:
    """``cuda.bindings.driver`` for one device with ``sms`` SMs and compute capability ``cc``."""

    CUresult = CUresult
    CU_DEV_SM_RESOURCE_GROUP_PARAMS = GroupParams
    CUdevResourceType = SimpleNamespace(CU_DEV_RESOURCE_TYPE_SM=1)
    CUgreenCtxCreate_flags = SimpleNamespace(CU_GREEN_CTX_DEFAULT_STREAM=1)
    CUstream_flags = SimpleNamespace(CU_STREAM_NON_BLOCKING=1)
    CUdriverProcAddress_flags = SimpleNamespace(CU_GET_PROC_ADDRESS_DEFAULT=0)
    CUdriverProcAddressQueryResult = ProcStatus
    CUdevice_attribute = SimpleNamespace(
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR=75, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR=76
    )

    def __init__(
        self,
        sms: int,
        cc: tuple[int, int] = (9, 0),
        *,
        version: int = 13000,
        granularity_fields: bool = True,
        fail: dict[str, CUresult] | None = None,
        raises: dict[str, Exception] | None = None,
        not_exported: set[str] | None = None,
        cuda: FakeCuda | None = None,
        fail_on_call: dict[str, int] | None = None,
        misreport_sms: int = 0,
    ) -> None:
        self.sms, self.cc, self.version = sms, cc, version
        self.min_size, self.align = GRANULARITY[cc[0]]
        self.granularity_fields = granularity_fields
        self.fail = dict(fail or {})
        self.raises = dict(raises or {})
        self.not_exported = set(not_exported or ())
        self.fail_on_call = dict(fail_on_call or {})  # fname → fail on the n-th call (1-based)
        self.misreport_sms = misreport_sms
        self.cuda = cuda
        self.log: list[tuple[str, Any]] = []
        self.calls: Counter[str] = Counter()
        self.live_streams: list[Handle] = []
        self.live_contexts: list[Handle] = []
        self.violations: list[str] = []
        self._ids = 0

    def without(self, *names: str) -> FakeDriver:
        """Hide bindings, as an older cuda-python would lack them."""
        for name in names:
            setattr(self, name, None)
        return self

    # -- plumbing ------------------------------------------------------------------------------

    def _enter(self, fname: str, arg: Any = None) -> CUresult | None:
        self.calls[fname] += 1
        self.log.append((fname, arg))
        if fname in self.raises:
            raise self.raises[fname]
        if self.fail_on_call.get(fname) == self.calls[fname]:
            return CUresult.CUDA_ERROR_NOT_SUPPORTED
        return self.fail.get(fname)

    def _handle(self, kind: str, sms: int = 0, ctx: Handle | None = None) -> Handle:
        self._ids += 1
        return Handle(kind, self._ids, sms, ctx)

    def _resource(self, count: int) -> Resource:
        if not self.granularity_fields:
            return Resource(OldSm(count))  # type: ignore[arg-type]
        return Resource(SmResource(count, self.min_size, self.align))

    # -- the driver API ------------------------------------------------------------------------

    def cuInit(self, flags: int):
        return (self._enter("cuInit") or CUresult.CUDA_SUCCESS,)

    def cuDriverGetVersion(self):
        return (self._enter("cuDriverGetVersion") or CUresult.CUDA_SUCCESS, self.version)

    def cuDeviceGet(self, index: int):
        return (self._enter("cuDeviceGet") or CUresult.CUDA_SUCCESS, 0)

    def cuDeviceGetName(self, length: int, dev: int):
        return (self._enter("cuDeviceGetName") or CUresult.CUDA_SUCCESS, b"Fake GPU\0\0\0")

    def cuDeviceGetAttribute(self, attr: int, dev: int):
        value = self.cc[0] if attr == 75 else self.cc[1]
        return (self._enter("cuDeviceGetAttribute") or CUresult.CUDA_SUCCESS, value)

    def cuGetProcAddress(self, symbol: bytes, version: int, flags: int):
        err = self._enter("cuGetProcAddress", symbol)
        if symbol.decode() in self.not_exported:
            return (err or CUresult.CUDA_SUCCESS, 0, ProcStatus.CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND)
        return (err or CUresult.CUDA_SUCCESS, 0xDEAD, ProcStatus.CU_GET_PROC_ADDRESS_SUCCESS)

    def cuDeviceGetDevResource(self, dev: int, typ: int):
        err = self._enter("cuDeviceGetDevResource")
        return (err, None) if err else (CUresult.CUDA_SUCCESS, self._resource(self.sms))

    def cuDevSmResourceSplitByCount(self, groups: int, resource: Resource, flags: int, min_count: int):
        err = self._enter("cuDevSmResourceSplitByCount", min_count)
        if err:
            return (err, None, 0, None)
        size = max(self.min_size, -(-min_count // self.align) * self.align)
        if size * groups > resource.sm.smCount:
            return (CUresult.CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION, None, 0, None)
        rest = resource.sm.smCount - size * groups
        return (
            CUresult.CUDA_SUCCESS,
            [self._resource(size) for _ in range(groups)],
            groups,
            self._resource(rest),
        )

    def cuDevSmResourceSplit(self, groups: int, resource: Resource, flags: int, params: list[GroupParams]):
        err = self._enter("cuDevSmResourceSplit", [p.smCount for p in params])
        if err:
            return (err, None, None)
        sizes = [p.smCount for p in params]
        if any(n < self.min_size or n % self.align for n in sizes) or sum(sizes) > resource.sm.smCount:
            return (CUresult.CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION, None, None)
        rest = resource.sm.smCount - sum(sizes)
        return (CUresult.CUDA_SUCCESS, [self._resource(n) for n in sizes], self._resource(rest))

    def cuDevResourceGenerateDesc(self, resources: list[Resource], n: int):
        err = self._enter("cuDevResourceGenerateDesc")
        return (err, None) if err else (CUresult.CUDA_SUCCESS, sum(r.sm.smCount for r in resources))

    def cuGreenCtxCreate(self, desc: int, dev: int, flags: int):
        err = self._enter("cuGreenCtxCreate", desc)
        if err:
            return (err, None)
        ctx = self._handle("ctx", sms=desc)
        self.live_contexts.append(ctx)
        return (CUresult.CUDA_SUCCESS, ctx)

    def cuGreenCtxGetDevResource(self, ctx: Handle, typ: int):
        err = self._enter("cuGreenCtxGetDevResource", ctx.id)
        return (err, None) if err else (CUresult.CUDA_SUCCESS, self._resource(ctx.sms + self.misreport_sms))

    def cuGreenCtxStreamCreate(self, ctx: Handle, flags: int, priority: int):
        err = self._enter("cuGreenCtxStreamCreate", ctx.id)
        if err:
            return (err, None)
        stream = self._handle("stream", ctx.sms, ctx)
        self.live_streams.append(stream)
        return (CUresult.CUDA_SUCCESS, stream)

    def cuStreamSynchronize(self, stream: Handle):
        return (self._enter("cuStreamSynchronize", stream.id) or CUresult.CUDA_SUCCESS,)

    def cuStreamDestroy(self, stream: Handle):
        self._enter("cuStreamDestroy", stream.id)
        if stream.ctx not in self.live_contexts:
            self.violations.append(f"stream {stream.id} destroyed after its context")
        if self.cuda is not None and self.cuda.using[int(stream)] > 0:
            self.violations.append(f"stream {stream.id} destroyed while a lane uses it")
        self.live_streams.remove(stream)
        return (CUresult.CUDA_SUCCESS,)

    def cuGreenCtxDestroy(self, ctx: Handle):
        self._enter("cuGreenCtxDestroy", ctx.id)
        if any(s.ctx is ctx for s in self.live_streams):
            self.violations.append(f"context {ctx.id} destroyed while it still has streams")
        self.live_contexts.remove(ctx)
        return (CUresult.CUDA_SUCCESS,)


@dataclass
class Gpu:
    """A fake driver and fake torch.cuda that know about each other."""

    sms: int = 132
    cc: tuple[int, int] = (9, 0)
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.cuda = FakeCuda(self.sms)
        self.drv = FakeDriver(self.sms, self.cc, cuda=self.cuda, **self.options)
