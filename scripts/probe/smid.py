"""A tiny kernel that records which SM each of its blocks ran on (``%smid``), through Triton or CuPy.

Each block reads ``%smid``, spins ``spin_ns`` on ``%globaltimer`` (so the blocks overlap in time and the
block scheduler spreads them over every SM it may use), and writes the id.  Launched on a lane's stream
it shows the SMs that lane's partition really has.
"""

from __future__ import annotations

from typing import Any

CUPY_SOURCE = r"""
extern "C" __global__ void record_smid(unsigned int* out, unsigned long long spin_ns) {
    unsigned int id;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < spin_ns);
    if (threadIdx.x == 0) out[blockIdx.x] = id;
}
"""


def _triton_launcher() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def record_smid(out_ptr, spin_ns):
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                       pack=1)
        t = t0
        while t - t0 < spin_ns:
            t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                          is_pure=False, pack=1)
        tl.store(out_ptr + tl.program_id(0), sm)

    def launch(out: Any, spin_ns: int) -> None:
        record_smid[(out.numel(),)](out, spin_ns, num_warps=1)

    return launch


def _cupy_launcher() -> Any:
    import cupy
    import torch

    kernel = cupy.RawKernel(CUPY_SOURCE, "record_smid")

    def launch(out: Any, spin_ns: int) -> None:
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(out.device).cuda_stream)
        args = (cupy.uint64(out.data_ptr()), cupy.uint64(spin_ns))
        kernel((out.numel(),), (32,), args, stream=stream)

    return launch


def smid_launcher() -> tuple[Any, str]:
    """``launch(out_int32_tensor, spin_ns)`` on the current stream, and which tool made it."""
    errors = []
    for name, make in (("triton", _triton_launcher), ("cupy", _cupy_launcher)):
        try:
            return make(), name
        except Exception as e:  # noqa: BLE001 - try the next tool, report both if neither works
            errors.append(f"{name}: {type(e).__name__}: {e}")
    raise RuntimeError("no way to read %smid: " + "; ".join(errors))


def sms_used(launch: Any, blocks: int, spin_ns: int, device: Any) -> set[int]:
    """The distinct SM ids of ``blocks`` blocks launched on the current stream (synchronises it)."""
    import torch

    out = torch.full((blocks,), -1, dtype=torch.int32, device=device)
    launch(out, spin_ns)
    torch.cuda.current_stream(device).synchronize()
    return {int(x) for x in out.cpu().tolist() if x >= 0}
