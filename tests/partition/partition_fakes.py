"""A fake ``cuda.bindings.driver`` (same tuple shapes) and a fake torch.cuda seam, for the GPU backends.

The fakes keep the rules a real driver and PyTorch enforce, so code that passes here has a chance on a GPU:

- **SM ids.**  The device has SMs ``0 .. sms-1``; only the first ``cluster_sms`` of them can be grouped
  into aligned, co-scheduled groups (on one H100, 8-SM clusters covered 120 of 132 SMs).  A split takes
  its groups from those SMs in order, so ``cuDevSmResourceSplitByCount`` forms *fewer groups* than
  ``sms // minCount`` — or none, which the driver reports as ``CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION``.
  Groups are rounded up to ``minSmPartitionSize`` / ``smCoscheduledAlignment``; the remainder is every
  SM of the input not in a group.
- **Separate splits are independent.**  Every split starts from the same SMs, so two green contexts made
  from two splits overlap; only the outputs of *one* split are disjoint (:meth:`FakeDriver.overlaps`).
- **Primary context first.**  ``cuGreenCtxCreate`` before the device's primary context exists is a
  violation; ``FakeCuda.init`` (torch's ``init`` + ``set_device``) does not create it, as torch does not.
- **Streams and events belong to a context.**  ``cuStreamCreateWithPriority`` makes its stream in the
  calling thread's current context (``cuCtxPushCurrent`` of a ``cuCtxFromGreenCtx`` handle, else the
  primary one).  An event belongs to its stream's device; a stream may only wait on events of its device.
- **Threads start on device 0.**  Each thread has its own current device (``FakeCuda.current_device``),
  0 until that thread calls ``set_device``.
- **Teardown order.**  A stream destroyed after its context, a context destroyed while it has streams, a
  stream destroyed while a lane uses it: each is recorded in ``violations``.

Compute capabilities 8.x (min 4, steps of 2), 9.0, 10.x and 12.x (min 8, steps of 8) are modelled.
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
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_ILLEGAL_ADDRESS = 700
    CUDA_ERROR_NOT_SUPPORTED = 801
    CUDA_ERROR_INVALID_RESOURCE_TYPE = 914
    CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION = 915


class ProcStatus(enum.IntEnum):
    CU_GET_PROC_ADDRESS_SUCCESS = 0
    CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1
    CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2


# What the driver reports in the SM resource (minSmPartitionSize, smCoscheduledAlignment) by CC major:
# 8.x: minimum 4 SMs in steps of 2; 9.0 (Hopper), 10.x (datacenter Blackwell), 12.x (RTX Blackwell): 8 and 8.
GRANULARITY = {8: (4, 2), 9: (8, 8), 10: (8, 8), 12: (8, 8)}


@dataclass
class SmResource:
    smCount: int
    minSmPartitionSize: int = 0
    smCoscheduledAlignment: int = 0


@dataclass
class Resource:
    sm: Any
    ids: frozenset[int] = frozenset()
    type: int = 1


class OldSm:
    """An SM resource from bindings older than 13.0: only ``smCount``."""

    def __init__(self, count: int) -> None:
        self.smCount = count


@dataclass(eq=False)
class Handle:
    kind: str
    id: int
    sms: frozenset[int] = frozenset()
    ctx: Handle | None = None  # a stream's green context (None: the primary context)
    device: int = 0

    def __int__(self) -> int:
        return 0x1000 + self.id


class FakeStream:
    """A torch stream: ``kind`` plain | external | green; ``handle`` the driver stream of an external one."""

    def __init__(self, kind: str, handle: Any = None, priority: int = 0, device: int = 0, cuda: Any = None) -> None:
        self.kind, self.handle, self.priority, self.device = kind, handle, priority, device
        self.cuda = cuda
        self.synced = 0
        self.recorded: list[FakeEvent] = []
        self.waited: list[FakeEvent] = []

    @property
    def context(self) -> Handle | None:
        return self.handle.ctx if isinstance(self.handle, Handle) else None

    def synchronize(self) -> None:
        self.synced += 1

    def record_event(self) -> FakeEvent:
        event = FakeEvent(self, self.device)
        self.recorded.append(event)
        return event

    def wait_event(self, event: FakeEvent) -> None:
        if event.device != self.device and self.cuda is not None:
            self.cuda.violations.append(f"stream on cuda:{self.device} waits on an event of cuda:{event.device}")
        self.waited.append(event)


@dataclass(eq=False)
class FakeEvent:
    stream: FakeStream
    device: int
    synced: int = 0

    def synchronize(self) -> None:
        self.synced += 1


class FakeCuda:
    """Stands in for :class:`TorchCuda`: per-thread current device and stream, the primary context.

    ``init`` is torch's ``init`` + ``set_device``, which does not create the primary context;
    ``ensure_context`` does.  ``fail_init`` makes ``init`` raise (a broken CUDA install)."""

    def __init__(self, sms: int = 132, available: bool = True, index: int = 0, fail_init: str = "") -> None:
        self.index = index
        self.sms = sms
        self.available = available
        self.fail_init = fail_init
        self.has_primary = False
        self.using: Counter[int] = Counter()  # handle id → lanes inside use()
        self.violations: list[str] = []
        self.bound_devices: list[tuple[str, int]] = []  # (thread name, device) of every set_device
        self._lock = threading.Lock()
        self._local = threading.local()

    def unavailable_reason(self) -> str | None:
        return None if self.available else "fake: no CUDA device"

    def init(self) -> None:
        if self.fail_init:
            raise RuntimeError(self.fail_init)
        self.set_device()

    def ensure_context(self) -> None:
        self.init()
        self.has_primary = True

    def set_device(self) -> None:
        self._local.device = self.index
        with self._lock:
            self.bound_devices.append((threading.current_thread().name, self.index))

    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    def device_name(self) -> str:
        return "Fake GPU"

    def sm_count(self) -> int:
        return self.sms

    def capability(self) -> tuple[int, int]:
        return (9, 0)

    def high_priority(self) -> int:
        return -5

    def plain_stream(self, priority: int = 0) -> FakeStream:
        return FakeStream("plain", priority=priority, device=self.index, cuda=self)

    def external_stream(self, handle: Any) -> FakeStream:
        return FakeStream("external", handle, device=getattr(handle, "device", self.index), cuda=self)

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

    def synchronize_device(self) -> None:
        self.device_syncs = getattr(self, "device_syncs", 0) + 1


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
        cluster_sms: int | None = None,
        fail: dict[str, CUresult] | None = None,
        raises: dict[str, Exception] | None = None,
        not_exported: set[str] | None = None,
        cuda: FakeCuda | None = None,
        fail_on_call: dict[str, int] | None = None,
        misreport_sms: int = 0,
        devices: int = 1,
        round_to: int = 0,
    ) -> None:
        self.sms, self.cc, self.version = sms, cc, version
        self.min_size, self.align = GRANULARITY[cc[0]]
        self.cluster_sms = (sms // self.align) * self.align if cluster_sms is None else cluster_sms
        self.granularity_fields = granularity_fields
        self.fail = dict(fail or {})
        self.raises = dict(raises or {})
        self.not_exported = set(not_exported or ())
        self.fail_on_call = dict(fail_on_call or {})  # fname → fail on the n-th call (1-based)
        self.misreport_sms = misreport_sms
        self.round_to = round_to  # groups really come in steps of this (0: the reported alignment)
        self.devices = devices
        self.cuda = cuda
        self.log: list[tuple[str, Any]] = []
        self.calls: Counter[str] = Counter()
        self.live_streams: list[Handle] = []
        self.live_contexts: list[Handle] = []
        self.violations: list[str] = []
        self._ids = 0
        self._ctx_stack = threading.local()

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

    def _handle(self, kind: str, sms: frozenset[int] = frozenset(), ctx: Handle | None = None) -> Handle:
        self._ids += 1
        return Handle(kind, self._ids, sms, ctx, self.cuda.index if self.cuda is not None else 0)

    def _resource(self, ids: frozenset[int], extra: int = 0) -> Resource:
        if not self.granularity_fields:
            return Resource(OldSm(len(ids) + extra), ids)
        return Resource(SmResource(len(ids) + extra, self.min_size, self.align), ids)

    def _group_size(self, count: int) -> int:
        step = self.round_to or self.align
        return max(self.min_size, -(-count // step) * step)

    def _carve(self, ids: frozenset[int], sizes: list[int]) -> tuple[list[frozenset[int]], frozenset[int]] | None:
        """Groups of ``sizes`` from the clusterable SMs of ``ids`` in order, or None if they do not fit."""
        pool = sorted(i for i in ids if i < self.cluster_sms)
        if sum(sizes) > len(pool):
            return None
        groups, at = [], 0
        for n in sizes:
            groups.append(frozenset(pool[at : at + n]))
            at += n
        return groups, ids - frozenset().union(*groups)

    def overlaps(self, a: Handle, b: Handle) -> frozenset[int]:
        """SM ids two green contexts (or their streams) share."""
        return a.sms & b.sms

    @property
    def _current_ctx(self) -> Handle | None:
        stack = getattr(self._ctx_stack, "stack", [])
        return stack[-1] if stack else None

    # -- device, version, symbols -----------------------------------------------------------------

    def cuInit(self, flags: int):
        return (self._enter("cuInit") or CUresult.CUDA_SUCCESS,)

    def cuDriverGetVersion(self):
        return (self._enter("cuDriverGetVersion") or CUresult.CUDA_SUCCESS, self.version)

    def cuDeviceGet(self, index: int):
        err = self._enter("cuDeviceGet", index)
        if err is None and index >= self.devices:
            err = CUresult.CUDA_ERROR_INVALID_VALUE
        return (err or CUresult.CUDA_SUCCESS, index)

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

    # -- SM resources and splits ------------------------------------------------------------------

    def cuDeviceGetDevResource(self, dev: int, typ: int):
        err = self._enter("cuDeviceGetDevResource", dev)
        return (err, None) if err else (CUresult.CUDA_SUCCESS, self._resource(frozenset(range(self.sms))))

    def cuDevSmResourceSplitByCount(self, groups: int, resource: Resource, flags: int, min_count: int):
        err = self._enter("cuDevSmResourceSplitByCount", min_count)
        if err:
            return (err, None, 0, None)
        size = self._group_size(min_count)
        formable = len([i for i in resource.ids if i < self.cluster_sms]) // size
        if groups == 0:  # result NULL: simulate, report how many groups would be formed
            return (CUresult.CUDA_SUCCESS, [], formable, self._resource(frozenset()))
        made = min(groups, formable)
        if made == 0:
            return (CUresult.CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION, None, 0, None)
        carved = self._carve(resource.ids, [size] * made)
        assert carved is not None
        parts, rest = carved
        return (CUresult.CUDA_SUCCESS, [self._resource(p) for p in parts], made, self._resource(rest))

    def cuDevSmResourceSplit(self, groups: int, resource: Resource, flags: int, params: list[GroupParams]):
        err = self._enter("cuDevSmResourceSplit", [p.smCount for p in params])
        if err:
            return (err, None, None)
        sizes = [p.smCount for p in params]
        if any(n < self.min_size or n % self.align for n in sizes):
            return (CUresult.CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION, None, None)
        carved = self._carve(resource.ids, sizes)
        if carved is None:
            return (CUresult.CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION, None, None)
        parts, rest = carved
        return (CUresult.CUDA_SUCCESS, [self._resource(p) for p in parts], self._resource(rest))

    def cuDevResourceGenerateDesc(self, resources: list[Resource], n: int):
        err = self._enter("cuDevResourceGenerateDesc")
        return (err, None) if err else (CUresult.CUDA_SUCCESS, frozenset().union(*(r.ids for r in resources)))

    # -- contexts ---------------------------------------------------------------------------------

    def cuGreenCtxCreate(self, desc: frozenset[int], dev: int, flags: int):
        err = self._enter("cuGreenCtxCreate", len(desc))
        if err:
            return (err, None)
        if self.cuda is not None and not self.cuda.has_primary:
            self.violations.append("green context created before the device's primary context")
        ctx = self._handle("ctx", sms=desc)
        self.live_contexts.append(ctx)
        return (CUresult.CUDA_SUCCESS, ctx)

    def cuGreenCtxGetDevResource(self, ctx: Handle, typ: int):
        err = self._enter("cuGreenCtxGetDevResource", ctx.id)
        return (err, None) if err else (CUresult.CUDA_SUCCESS, self._resource(ctx.sms, self.misreport_sms))

    def cuCtxFromGreenCtx(self, ctx: Handle):
        err = self._enter("cuCtxFromGreenCtx", ctx.id)
        return (err, None) if err else (CUresult.CUDA_SUCCESS, SimpleNamespace(green=ctx))

    def cuCtxPushCurrent(self, ctx: Any):
        err = self._enter("cuCtxPushCurrent")
        if not err:
            stack = getattr(self._ctx_stack, "stack", [])
            self._ctx_stack.stack = [*stack, ctx.green]
        return (err or CUresult.CUDA_SUCCESS,)

    def cuCtxPopCurrent(self):
        err = self._enter("cuCtxPopCurrent")
        stack = getattr(self._ctx_stack, "stack", [])
        if err or not stack:
            return (err or CUresult.CUDA_ERROR_INVALID_CONTEXT, None)
        self._ctx_stack.stack = stack[:-1]
        return (CUresult.CUDA_SUCCESS, SimpleNamespace(green=stack[-1]))

    # -- streams ----------------------------------------------------------------------------------

    def cuGreenCtxStreamCreate(self, ctx: Handle, flags: int, priority: int):
        err = self._enter("cuGreenCtxStreamCreate", ctx.id)
        if err:
            return (err, None)
        stream = self._handle("stream", ctx.sms, ctx)
        self.live_streams.append(stream)
        return (CUresult.CUDA_SUCCESS, stream)

    def cuStreamCreateWithPriority(self, flags: int, priority: int):
        """A stream in the calling thread's current context: the pushed green one, else the primary one."""
        err = self._enter("cuStreamCreateWithPriority", priority)
        if err:
            return (err, None)
        ctx = self._current_ctx
        stream = self._handle("stream", ctx.sms if ctx else frozenset(range(self.sms)), ctx)
        self.live_streams.append(stream)
        return (CUresult.CUDA_SUCCESS, stream)

    def cuStreamSynchronize(self, stream: Handle):
        return (self._enter("cuStreamSynchronize", stream.id) or CUresult.CUDA_SUCCESS,)

    def cuStreamDestroy(self, stream: Handle):
        self._enter("cuStreamDestroy", stream.id)
        if stream.ctx is not None and stream.ctx not in self.live_contexts:
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
    index: int = 0

    def __post_init__(self) -> None:
        self.cuda = FakeCuda(self.sms, index=self.index)
        self.cuda.capability = lambda: self.cc  # type: ignore[method-assign]
        self.drv = FakeDriver(self.sms, self.cc, cuda=self.cuda, devices=self.index + 1, **self.options)

    @property
    def violations(self) -> list[str]:
        return self.drv.violations + self.cuda.violations

    def lane_sms(self, backend: Any, rung: int) -> tuple[frozenset[int], frozenset[int]]:
        """The SM ids the decode and prefill streams of ``rung`` can run on."""
        from agentserve.protocol.lanes import Lane

        everything = frozenset(range(self.sms))
        return tuple(  # type: ignore[return-value]
            s.handle.sms if isinstance(s.handle, Handle) else everything
            for s in (backend.stream_for(Lane.DECODE, rung), backend.stream_for(Lane.PREFILL, rung))
        )
