"""``agentserve up --trace-steps FILE``: one JSON line per executor step, for offline analysis.

Each line describes a step as it lands (results arrive in plan order per lane)::

    {"step": 812, "lane": "decode", "rung": 1, "planned": 1234.555, "start": 1234.56, "end": 1234.60,
     "ms": 41.2, "gap_ms": 0.8, "seqs": 4, "decode_seqs": 3, "prefill_tokens": 16,
     "prefills": [{"seq": 7, "phase": "resume", "tokens": 16, "arrival": 1234.52, "samples": true}],
     "policy": {...}}

``planned`` is when the scheduler planned the step (the orchestrator's clock), ``start`` / ``end`` when
the executor ran it (its ``start`` includes any wait for the lane's cores); both are ``time.monotonic()``,
one clock for every process of the machine.  ``seqs`` counts the plan's sequences, ``decode_seqs`` those fed
one decode token, ``prefill_tokens`` the prompt tokens of the others; ``prefills`` lists those others: the
sequence, its class (``cold`` / ``resume``), its tokens in this step, when its turn arrived, and whether
the step samples a token (its first unless the turn was preempted and is computed again; ``end - arrival``
is then its TTFT in the server).  ``policy`` is the scheduler policy's state when the step landed (for
AgentServe: ``B_prefill``, the ``R_min`` rung, the controlled TPOT).
Step times beside each other on the two lanes, and steps with prefill riding in decode, show where
a TPOT or TTFT figure comes from (``scripts/`` analyses need nothing but ``json``).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from agentserve.orchestrator.scheduler.batch import Entry
from agentserve.protocol.lanes import Lane
from agentserve.protocol.ring_messages import Result

log = logging.getLogger(__name__)


class StepTrace:
    """Appends step records to a file (line-buffered, so a killed server leaves whole lines)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._file: IO[str] = self.path.open("a", buffering=1)
        except OSError as e:
            raise ValueError(f"cannot write the step trace {self.path}: {e.strerror}") from None

    def record(self, result: Result, entries: Sequence[Entry], planned: float, policy: dict[str, object]) -> None:
        """One landed step; ``entries`` are its plan's sequences, ``planned`` when the scheduler planned it.

        A failed write (disk full) stops the trace with one error in the log; serving goes on."""
        if self._file.closed:
            return
        decode = sum(1 for _, _, _, is_decode in entries if is_decode)
        prefills = [
            {"seq": req.seq_id, "phase": req.phase.name.lower(), "tokens": n, "arrival": req.arrival, "samples": sample}
            for req, n, sample, is_decode in entries if not is_decode
        ]
        prefill = sum(p["tokens"] for p in prefills)
        line = {
            "step": result.step, "lane": Lane(result.lane).name.lower(), "rung": result.rung, "planned": planned,
            "start": result.t_start, "end": result.t_end, "ms": round((result.t_end - result.t_start) * 1e3, 3),
            "gap_ms": round(result.gap_ms, 3), "seqs": len(entries), "decode_seqs": decode,
            "prefill_tokens": prefill, "prefills": prefills, "policy": policy,
        }
        try:
            self._file.write(json.dumps(line, default=str) + "\n")
        except OSError as e:
            log.error("step trace %s stopped: %s", self.path, e)
            self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):  # what a full disk kept in the buffer is lost
            self._file.close()
