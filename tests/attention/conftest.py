"""Attention tests run the Triton kernels in Triton's CPU interpreter.

``TRITON_INTERPRET`` must be set before Triton makes the kernels (when they are imported) and stay set while
they first launch (Triton imports its interpreter lazily), so it is set here, when pytest collects this
folder.  Nothing else in the test process imports Triton: on a CPU no other backend touches it.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"
