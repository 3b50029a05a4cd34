"""Why ``torch.cuda.green_contexts`` is not used as a partition backend (the reason detection records).

torch (2.10 – 2.13) makes one green context per ``GreenContext.create(num_sms=...)``, and every create
runs its own split: two contexts made for the decode and the prefill lane can share SMs (pytorch#195378),
and torch reports neither which nor how many SMs a context got.  Lanes on such contexts are not
partitioned, and a rung could not even state its real sizes, so when the driver path fails the executor
falls back to two plain streams (``cuda-streams``, reported not partitioned, whole-device sizes) and this
text says how to get real partitions.
"""

from __future__ import annotations

INSTALL = "pip install 'cuda-python>=12.4' (driver bindings) for disjoint partitions"


def why_not_torch_green() -> str:
    """One line: what torch's green contexts lack here, and the fix."""
    try:
        import torch.cuda.green_contexts as green
    except ImportError as e:
        return f"missing in this torch ({e}); {INSTALL}"
    if not getattr(green, "SUPPORTED", False):
        return f"this torch was not built with green-context support; {INSTALL}"
    return (
        "not used: each GreenContext.create runs its own split, so the decode and prefill contexts may share "
        f"SMs and torch does not report their SM counts (pytorch#195378); {INSTALL}"
    )
