"""Fill the stats snapshot that ``agentserve top`` reads, and put it on the stats board.

The server calls :meth:`on_result` for every executor result (lane utilisation, tokens) and
:meth:`on_turn_done` for every finished turn; :meth:`publish` builds a
:class:`~agentserve.protocol.stats.Snapshot` from those, the scheduler's ``stats()``
and the session table, and overwrites the board (a seqlock: readers never block this writer).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from msgspec.structs import replace

from agentserve.orchestrator.running_turn import RunningTurn
from agentserve.protocol.lanes import Lane, backend_unit
from agentserve.protocol.ring_messages import Ready, Result
from agentserve.protocol.stats import (
    SNAPSHOT_VERSION,
    Control,
    Kv,
    LaneStat,
    Latency,
    Partition,
    Queues,
    Server,
    SessionRow,
    SessionState,
    Snapshot,
    encode_snapshot,
)
from agentserve.shm.board import StatsBoard
from agentserve.shm.errors import MessageTooLarge

if TYPE_CHECKING:
    from agentserve.orchestrator.server import Server as OrchestratorServer
    from agentserve.orchestrator.server import SessionRecord

log = logging.getLogger("agentserve.orchestrator.stats")

BOARD_BYTES = 256 * 1024
ARRAY_HEADER_BYTES = 5  # msgpack's largest list header (array 32)
NAME_CHARS = 64  # a session's name as `top` shows it
WINDOW_S = 10.0
HISTORY = 60
HISTORY_EVERY_S = 1.0


# the order rows are kept in when the board cannot hold them all: sessions at work first, the newest first within each
_BUSIEST = {state: rank for rank, state in enumerate(
    (SessionState.DECODING, SessionState.PREFILLING, SessionState.QUEUED, SessionState.IN_TOOL, SessionState.IDLE))}


def fit_sessions(snap: Snapshot, data: bytes, capacity: int) -> bytes:
    """``data`` (``snap`` encoded) if it fits in ``capacity`` bytes, else ``snap`` listing only the busiest sessions
    that fit (``sessions_total`` still counts them all); what fits nothing is returned as it is."""
    if len(data) <= capacity:
        return data
    rows = sorted(snap.sessions, key=lambda r: (_BUSIEST[r.state], -r.id))
    snap = replace(snap, sessions_total=max(snap.sessions_total, len(rows)))
    room = capacity - len(encode_snapshot(replace(snap, sessions=[]))) - ARRAY_HEADER_BYTES
    keep = 0
    for row in rows:  # a list's encoding is its header and its items' encodings, one after another
        room -= len(encode_snapshot(row))
        if room < 0:
            break
        keep += 1
    return encode_snapshot(replace(snap, sessions=rows[:keep]))


def _ms(summary: dict[str, Any], key: str) -> float:
    value = summary.get(key)
    return 0.0 if value is None else float(value) * 1e3


class StatsPublisher:
    def __init__(self, run: str, endpoint: str, model: str, tpot_slo_ms: float, ttft_slo_ms: float) -> None:
        self.info = Server(pid=os.getpid(), endpoint=endpoint, run=run, model=model, started_wall=time.time())
        self.tpot_slo_ms, self.ttft_slo_ms = tpot_slo_ms, ttft_slo_ms
        self.board = StatsBoard.create(run, BOARD_BYTES, SNAPSHOT_VERSION)
        self.seq = 0
        self.steps: dict[Lane, deque[tuple[float, float, int, float]]] = {lane: deque() for lane in Lane}
        self.turns_done = 0
        self.tokens_out = 0
        self.out_times: deque[tuple[float, int]] = deque()
        self.history: dict[str, deque[float]] = {"tpot": deque(maxlen=HISTORY), "ttft": deque(maxlen=HISTORY)}
        self._next_history = 0.0
        self._warned = False

    def close(self) -> None:
        self.board.close()

    # ---- inputs -------------------------------------------------------------------------------
    def on_result(self, result: Result) -> None:
        n = sum(1 for s in result.seqs if s.token_id >= 0)
        steps = self.steps[Lane(result.lane)]
        steps.append((result.t_start, result.t_end, n, result.gap_ms))
        while steps and steps[0][1] < result.t_end - WINDOW_S:
            steps.popleft()
        self.tokens_out += n
        self.out_times.append((result.t_end, n))

    def on_turn_done(self, turn: RunningTurn) -> None:
        self.turns_done += 1

    # ---- output -------------------------------------------------------------------------------
    def publish(self, server: OrchestratorServer, now: float) -> None:
        """Put a snapshot on the board; with more sessions than its bytes hold, the busiest that fit are listed."""
        snap = self.snapshot(server, now)
        data = encode_snapshot(snap)
        try:
            self.board.publish(fit_sessions(snap, data, self.board.capacity))
        except MessageTooLarge as e:  # not even without sessions (256 KiB): `top` ends after 15 s of no new stats
            if not self._warned:
                log.warning("stats snapshot not published: %s", e)
                self._warned = True

    def encode(self, server: OrchestratorServer, now: float) -> bytes:
        """The whole snapshot, every session listed (the ``GetStats`` reply)."""
        return encode_snapshot(self.snapshot(server, now))

    def snapshot(self, server: OrchestratorServer, now: float) -> Snapshot:
        self.seq += 1
        stats = server.sched.stats(now)
        return Snapshot(
            version=SNAPSHOT_VERSION,
            seq=self.seq,
            t_wall=time.time(),
            server=self._server(server),
            partition=self._partition(server.link.ready, stats),
            control=self._control(stats),
            tpot=self._latency("tpot", stats.get("tpot_s") or {}, self.tpot_slo_ms, now),
            ttft=self._latency("ttft", stats.get("ttft_s") or {}, self.ttft_slo_ms, now),
            queues=self._queues(stats.get("queues") or {}),
            kv=self._kv(stats, server.link.ready),
            lanes=[self._lane(lane, now) for lane in Lane],
            sessions=[self._row(rec) for rec in server.sessions.values()],
            sessions_total=len(server.sessions),
            turns_done=self.turns_done,
            tokens_out=self.tokens_out,
            tokens_per_s=self._tokens_per_s(now),
            restarting=server.restarting,
        )

    def _server(self, server: OrchestratorServer) -> Server:
        ready = server.link.ready
        info = self.info
        info.device = ready.device if ready else ""
        info.uptime_s = time.time() - info.started_wall
        return info

    def _partition(self, ready: Ready | None, stats: dict[str, Any]) -> Partition:
        if ready is None or not ready.ladder:
            return Partition()
        index = int(stats.get("r_min_rung", stats.get("rung", len(ready.ladder) - 1)) or 0)
        rung = ready.ladder[min(index, len(ready.ladder) - 1)]
        full = ready.ladder[-1]
        return Partition(
            rung=rung.index,
            num_rungs=len(ready.ladder),
            decode_units=rung.decode_units,
            prefill_units=rung.prefill_units,
            total_units=max(full.decode_units, rung.decode_units + rung.prefill_units if rung.partitioned else 0),
            unit=backend_unit(ready.backend),
            partitioned=rung.partitioned,
            backend=ready.backend,
            reason=ready.reason,
        )

    def _control(self, stats: dict[str, Any]) -> Control:
        return Control(
            policy=str(stats.get("policy", "")),
            b_prefill=int(stats.get("b_prefill", 0) or 0),
            r_min=int(stats.get("r_min_rung", 0) or 0),
            adjustments=int(stats.get("control_changes", 0) or 0),
        )

    def _latency(self, name: str, summary: dict[str, Any], slo_ms: float, now: float) -> Latency:
        p50 = _ms(summary, "p50")
        history = self.history[name]
        if summary.get("n") and now >= self._next_history:
            history.append(p50)
            if name == "ttft":
                self._next_history = now + HISTORY_EVERY_S
        return Latency(p50_ms=p50, p95_ms=_ms(summary, "p95"), last_ms=p50, slo_ms=slo_ms, history_ms=list(history))

    @staticmethod
    def _queues(q: dict[str, int]) -> Queues:
        return Queues(
            cold=q.get("cold_waiting", 0) + q.get("cold_prefilling", 0),
            resume=q.get("resume_waiting", 0) + q.get("resume_prefilling", 0),
            decode=q.get("decoding", 0),
        )

    @staticmethod
    def _kv(stats: dict[str, Any], ready: Ready | None) -> Kv:
        kv = stats.get("kv") or {}
        return Kv(
            used_blocks=int(kv.get("used", 0)),
            total_blocks=int(kv.get("blocks", 0)),
            pinned_blocks=int(kv.get("held_by_sessions", 0)),
            block_size=ready.block_size if ready else 0,
            prefix_hit_rate=float(stats.get("prefix_hit_rate", 0.0) or 0.0),
            preemptions=int(stats.get("preemptions", 0)),
            evictions=int(kv.get("evictions", 0)),
            pins_broken=int(stats.get("pins_broken", 0)),
        )

    def _lane(self, lane: Lane, now: float) -> LaneStat:
        steps = self.steps[lane]
        recent = [s for s in steps if s[1] > now - WINDOW_S]
        busy = sum(min(end, now) - max(start, now - WINDOW_S) for start, end, _, _ in recent)
        tokens = sum(n for _, _, n, _ in recent)
        last = (steps[-1][1] - steps[-1][0]) * 1e3 if steps else 0.0
        gaps = sorted(gap for *_, gap in recent)
        return LaneStat(
            name=lane.name.lower(),
            utilisation=max(0.0, min(1.0, busy / WINDOW_S)),
            steps=len(steps),
            last_step_ms=last,
            tokens_per_s=tokens / WINDOW_S,
            gap_p50_ms=gaps[len(gaps) // 2] if gaps else 0.0,
        )

    def _tokens_per_s(self, now: float) -> float:
        while self.out_times and self.out_times[0][0] < now - WINDOW_S:
            self.out_times.popleft()
        return sum(n for _, n in self.out_times) / WINDOW_S

    @staticmethod
    def _row(rec: SessionRecord) -> SessionRow:
        turn = rec.turn or rec.last
        if rec.turn is not None:
            state = SessionState.DECODING if rec.turn.token_ids else SessionState.PREFILLING
        elif rec.last is not None and rec.last.tool_calls_made:
            state = SessionState.IN_TOOL
        else:
            state = SessionState.IDLE
        timings = turn.timings(turn.last_token_t) if turn is not None and turn.token_ids else None
        return SessionRow(
            id=rec.session,
            name=rec.name[:NAME_CHARS],
            state=state,
            turn=rec.turns,
            context_tokens=len(rec.conversation.tokens) if rec.turn is None else rec.turn.prompt_tokens,
            turn_tokens=len(turn.token_ids) if turn is not None else 0,
            last_ttft_ms=timings.ttft_ms if timings else 0.0,
            last_tpot_ms=timings.tpot_ms if timings else 0.0,
        )
