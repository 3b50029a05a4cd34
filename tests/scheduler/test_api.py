"""The Scheduler API the server drives: sessions, turns, retention pins, aborts, events, config."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
from simulation.fake_executor import FakeExecutor, ready

from agentserve.configs import ConfigError
from agentserve.orchestrator.policies import POLICY_NAMES, make_policy
from agentserve.orchestrator.scheduler.config import SchedulerConfig, load_config
from agentserve.orchestrator.scheduler.request import Phase
from agentserve.orchestrator.scheduler.scheduler import Scheduler
from agentserve.orchestrator.scheduler.window import Window
from agentserve.protocol.lanes import CPU_CORES_BACKEND, Lane
from agentserve.protocol.ring_messages import ExecError, Plan, Release
from agentserve.protocol.sampling import Finish, SamplingParams

BS = 16


class Driver:
    """A scheduler and a fake executor on a manual clock."""

    def __init__(self, policy: str = "agentserve", num_blocks: int = 256, lookahead: int = 0,
                 backend: str = "fake") -> None:
        self.now = 0.0
        info = ready(num_blocks, BS, backend=backend)
        # These tests step a manual clock through one plan at a time; overlap (queued plans) has
        # its own tests (test_lookahead_*, test_hol_blocking, test_properties).
        base = SchedulerConfig()
        config = dataclasses.replace(base, scheduler=dataclasses.replace(base.scheduler, decode_lookahead=lookahead))
        self.sched = Scheduler(policy, info, config, clock=lambda: self.now)
        self.exe = FakeExecutor(info, oracle=lambda s: getattr(self.sched.requests.get(s), "tokens", None))
        self.pending: list = []
        self.events: list = []
        self.released: list[int] = []

    def pump(self) -> list[Plan]:
        plans = []
        for msg in self.sched.schedule(self.now):
            if isinstance(msg, Release):
                self.released += msg.seq_ids
                self.exe.release(msg)
            else:
                plans.append(msg)
                self.pending.append(self.exe.run(msg, self.now))
        self.events += self.sched.take_events()
        return plans

    def land(self) -> None:
        self.pending.sort(key=lambda r: r.t_end)
        result = self.pending.pop(0)
        self.now = max(self.now, result.t_end)
        self.events += self.sched.on_result(result, self.now)

    def until_finished(self, seq_id: int) -> None:
        for _ in range(10_000):
            if any(e.seq_id == seq_id and e.finished for e in self.events):
                return
            self.pump()
            self.land()
            self.sched.check()
        raise AssertionError("never finished")


def test_registry_accepts_every_policy_and_lists_names_on_error():
    for name in POLICY_NAMES:
        assert make_policy(name).name == name
    assert set(POLICY_NAMES) == {"agentserve", "fcfs", "chunked", "llamacpp", "no-feedback", "no-partition"}
    with pytest.raises(ValueError, match="agentserve, fcfs, chunked, llamacpp, no-feedback, no-partition"):
        make_policy("vllm")


def test_config_files_load_and_override():
    cfg = load_config()
    assert cfg == SchedulerConfig(), "the TOML files and the dataclass defaults agree"
    cfg = load_config(environ={"AGENTSERVE_SLO_TPOT_TARGET_MS": "30"}, overrides={"chunked": {"token_budget": 64}})
    assert cfg.slo.tpot_target_ms == 30.0 and cfg.chunked.token_budget == 64
    with pytest.raises(ConfigError, match="bogus"):
        load_config(overrides={"controller": {"bogus": 1}})
    with pytest.raises(ConfigError, match="theta_low < theta_high"):
        load_config(overrides={"slo": {"theta_low": 0.9, "theta_high": 0.8}})
    with pytest.raises(ConfigError, match="prefill_lane_resumes in"):
        load_config(overrides={"scheduler": {"prefill_lane_resumes": "always"}})
    with pytest.raises(ConfigError, match="resume_ride_after_ms >= 0"):
        load_config(environ={"AGENTSERVE_SCHEDULER_RESUME_RIDE_AFTER_MS": "-1"})


def test_submit_validates():
    d = Driver(num_blocks=8)
    sid = d.sched.open_session("a")
    with pytest.raises(ValueError, match="does not fit"):
        d.sched.submit(sid, list(range(10, 10 + 8 * BS)))
    with pytest.raises(KeyError):
        d.sched.submit("nope", [1, 2, 3])
    d.sched.submit(sid, [11, 12])
    with pytest.raises(RuntimeError, match="already runs"):
        d.sched.submit(sid, [13])
    with pytest.raises(ValueError, match="max_tokens"):
        d.sched.submit(d.sched.open_session(), [1], SamplingParams(max_tokens=0))


def test_classes_from_what_is_cached_and_tool_retention():
    d = Driver()
    sid = d.sched.open_session("agent")
    cold = d.sched.submit(sid, list(range(10, 1010)), SamplingParams(max_tokens=5, ignore_eos=True))
    assert d.sched.requests[cold].phase is Phase.COLD
    d.until_finished(cold)
    d.sched.end_turn(cold, in_tool_call=True, now=d.now)
    session = d.sched.sessions[sid]
    assert session.holds_blocks and session.pin_deadline > d.now, "pinned while the tool runs"
    d.now += 1.0
    resume = d.sched.submit(sid, list(range(5000, 5060)), SamplingParams(max_tokens=5, ignore_eos=True))
    req = d.sched.requests[resume]
    assert req.phase is Phase.RESUME
    assert list(session.tool_latencies) == [pytest.approx(1.0)]
    d.until_finished(resume)
    assert req.num_cached == 1004, "the whole previous turn (but its last sampled token) was resident"
    assert d.sched.stats()["prefix_hit_rate"] > 0.4


def _a_turn_ended_in_a_tool_call_with_a_plan_still_out(d: Driver) -> tuple[str, list[int]]:
    """A session's 1,000-token turn, finished (6 tokens) and ended in a tool call while the decode plan queued ahead
    of its last token still runs; the session and the turn's tokens."""
    sid = d.sched.open_session("agent")
    seq = d.sched.submit(sid, list(range(10, 1010)), SamplingParams(max_tokens=6, ignore_eos=True))
    while not any(e.seq_id == seq and e.finished for e in d.events):
        d.pump()
        d.land()
    assert d.pending, "a plan sent ahead is still running"
    d.sched.end_turn(seq, in_tool_call=True, now=d.now)
    return sid, d.sched.sessions[sid].tokens


@pytest.mark.parametrize("full_prompt", [False, True])
def test_a_tool_result_sent_before_the_last_plan_is_back_still_resumes_on_the_kept_kv(full_prompt):
    """A client that answers a tool call at once (its result arrives while a decode plan sent ahead for the
    finished turn is still running) gets the whole turn's KV, as one that answers later does."""
    d = Driver(lookahead=1)
    # between what the prefix cache's full blocks leave uncached (74 tokens) and what the kept KV does (61): the
    # turn is classed cold when it comes and must be classed a resume once it has the kept KV
    threshold = dataclasses.replace(d.sched.config.scheduler, cold_threshold_tokens=64)
    d.sched.config = dataclasses.replace(d.sched.config, scheduler=threshold)
    sid, held = _a_turn_ended_in_a_tool_call_with_a_plan_still_out(d)
    tool = list(range(5000, 5060))
    d.now += 0.002  # the tool's time, shorter than the plan still running
    resume = d.sched.submit(sid, held + tool if full_prompt else tool, SamplingParams(max_tokens=2, ignore_eos=True),
                            full_prompt=full_prompt, now=d.now)
    assert d.sched.requests[resume].phase is Phase.COLD
    assert list(d.sched.sessions[sid].tool_latencies) == [pytest.approx(0.002)], "timed from the turn's end"
    d.pump()  # as the server does right after a submit: the turn is not admitted yet, its table is on its way
    assert d.sched.requests[resume].num_cached == 0 and d.sched.requests[resume].block_table == []
    d.land()  # the plan sent ahead comes back: the finished turn lets go of its blocks
    req = d.sched.requests[resume]
    assert req.phase is Phase.RESUME, "classed by the kept KV, not by the prefix cache's full blocks"
    d.until_finished(resume)
    assert req.num_cached == len(held) - 1, "the whole previous turn (but its last sampled token) was resident"
    d.sched.check()


def test_a_turn_let_go_after_the_next_one_ended_keeps_only_what_the_conversation_still_shares():
    """The next turn came (its prompt diverging from the finished turn's tokens) and was aborted while the finished
    turn's last plan still ran: the table that plan brings back is kept only for the prefix both share, so a third
    turn appended to the conversation is served KV of its own tokens (the fake executor checks every cached
    token against the prompt)."""
    d = Driver(lookahead=1)
    sid, held = _a_turn_ended_in_a_tool_call_with_a_plan_still_out(d)
    edited = held[:500] + list(range(7000, 7100))  # a conversation that diverges at token 500
    second = d.sched.submit(sid, edited, SamplingParams(max_tokens=2), full_prompt=True, now=d.now)
    d.pump()
    d.sched.abort(second, d.now)
    d.land()  # the finished turn lets go now: its table must not stand for the edited conversation
    session = d.sched.sessions[sid]
    assert session.tokens == edited and session.num_computed <= 496
    third = d.sched.submit(sid, list(range(8000, 8020)), SamplingParams(max_tokens=2, ignore_eos=True), now=d.now)
    d.until_finished(third)
    assert 0 < d.sched.cached_tokens(third) <= 496
    d.sched.check()


def test_tool_ttl_comes_from_observed_latencies():
    d = Driver()
    sid = d.sched.open_session()
    for latency in (2.0, 4.0, 3.0):
        seq = d.sched.submit(sid, [20, 21, 22], SamplingParams(max_tokens=2, ignore_eos=True), now=d.now)
        d.until_finished(seq)
        d.sched.end_turn(seq, in_tool_call=True, now=d.now)
        pinned_at = d.now
        d.now += latency
    kv = SchedulerConfig().kv
    ttl = d.sched.sessions[sid].pin_deadline - pinned_at
    assert ttl == pytest.approx(min(kv.ttl_cap_s, 4.0 * kv.ttl_margin)), "q90 of (2, 4) x margin"


def test_pin_expires_then_blocks_are_only_cached():
    d = Driver()
    sid = d.sched.open_session()
    seq = d.sched.submit(sid, list(range(10, 110)), SamplingParams(max_tokens=3, ignore_eos=True))
    d.until_finished(seq)
    d.sched.end_turn(seq, in_tool_call=True, now=d.now)
    held = d.sched.stats()["kv"]["held_by_sessions"]
    assert held == 7
    d.now = d.sched.sessions[sid].pin_deadline + 0.01
    d.pump()
    stats = d.sched.stats()
    assert stats["kv"]["held_by_sessions"] == 0 and stats["kv"]["used"] == 0
    assert stats["kv"]["cached"] == 6, "full blocks stay findable by prefix hash"


def test_blocks_two_pinned_sessions_share_count_once():
    """Sessions with one system prompt share its blocks: the count summed their tables, so it passed the pool's size
    (3 sessions, 46 of 64 blocks used: 114 pinned, in a QA run)."""
    d = Driver()
    shared = list(range(10, 74))  # 4 full blocks of 16
    for tail in ([1, 2, 3], [4, 5, 6]):
        sid = d.sched.open_session()
        seq = d.sched.submit(sid, shared + tail, SamplingParams(max_tokens=3, ignore_eos=True), now=d.now)
        d.until_finished(seq)
        d.sched.end_turn(seq, in_tool_call=True, now=d.now)
    kv = d.sched.stats()["kv"]
    assert kv["held_by_sessions"] == kv["used"] == 4 + 2 * 1  # the shared blocks once, a last block each


def test_turn_without_tool_call_and_close_release_at_once():
    d = Driver()
    sid = d.sched.open_session()
    seq = d.sched.submit(sid, list(range(10, 110)), SamplingParams(max_tokens=3, ignore_eos=True))
    d.until_finished(seq)
    assert d.sched.stats()["kv"]["held_by_sessions"] > 0, "kept for a grace until end_turn"
    d.sched.end_turn(seq, in_tool_call=False, now=d.now)
    assert d.sched.stats()["kv"]["used"] == 0
    seq = d.sched.submit(sid, [7, 8, 9], SamplingParams(max_tokens=3, ignore_eos=True), now=d.now)
    d.until_finished(seq)
    d.sched.end_turn(seq, in_tool_call=True, now=d.now)
    assert d.sched.stats()["kv"]["used"] > 0
    d.sched.close_session(sid, now=d.now)
    assert d.sched.stats()["kv"]["used"] == 0 and sid not in d.sched.sessions
    d.pump()
    assert seq in d.released


def test_abort_waiting_and_in_flight():
    d = Driver("chunked")
    a = d.sched.submit(d.sched.open_session(), [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    events = d.sched.abort(a)
    assert [(e.seq_id, e.finish) for e in events] == [(a, Finish.ABORT)]
    b = d.sched.submit(d.sched.open_session(), [4, 5, 6], SamplingParams(max_tokens=50, ignore_eos=True))
    assert d.pump(), "b is in flight"
    assert d.sched.abort(b) == [], "in flight: the abort lands with its result"
    d.land()
    assert any(e.seq_id == b and e.finish is Finish.ABORT for e in d.events)
    d.pump()
    assert b in d.released and d.sched.idle()


def test_eos_and_stop_tokens_finish_with_stop():
    d = Driver("chunked")
    sid = d.sched.open_session()
    first = d.sched.submit(sid, [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    d.pump()
    d.land()
    token = d.events[-1].token_id
    d.sched.abort(first)
    sid2 = d.sched.open_session()
    seq = d.sched.submit(sid2, [1, 2, 3], SamplingParams(max_tokens=50, stop_token_ids=[token]))
    d.exe._sample = lambda s, p: token  # every sample is the stop token
    d.until_finished(seq)
    assert d.events[-1].finish is Finish.STOP and d.events[-1].num_output == 1


def test_full_prompt_keeps_the_common_prefix_only():
    d = Driver()
    sid = d.sched.open_session()
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    seq = d.sched.submit(sid, list(range(10, 110)), sp)
    d.until_finished(seq)
    d.sched.end_turn(seq, in_tool_call=True, now=d.now)
    conversation = d.sched.sessions[sid].tokens
    rewritten = conversation[:50] + [1, 2, 3] + conversation[53:] + [99]  # a chat template re-render
    seq2 = d.sched.submit(sid, rewritten, sp, full_prompt=True, now=d.now)
    req = d.sched.requests[seq2]
    d.until_finished(seq2)  # the fake executor checks the reused KV against the new tokens
    assert req.num_cached == 48, "3 whole blocks before the first difference at position 50"
    assert d.sched.stats()["finished"] == 2


def test_stats_shape():
    d = Driver()
    stats = d.sched.stats()
    for key in ("policy", "b_prefill", "r_min_rung", "queues", "kv", "prefix_hit_rate", "tpot_s", "ttft_s"):
        assert key in stats
    queues = {"cold_waiting", "resume_waiting", "cold_prefilling", "resume_prefilling", "decoding"}
    assert set(stats["queues"]) == queues
    assert stats["lanes_busy"] == {"decode": False, "prefill": False}


def test_two_lane_plans_carry_lane_and_rung():
    d = Driver()
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    d.sched.submit(d.sched.open_session(), list(range(10, 60)), sp)
    d.sched.submit(d.sched.open_session(), list(range(100, 3100)), sp)
    plans = d.pump()
    lanes = {p.lane: p for p in plans}
    assert set(lanes) == {Lane.DECODE, Lane.PREFILL}, "nothing decodes yet: the short prompt rides at once"
    assert lanes[Lane.DECODE].rung == lanes[Lane.PREFILL].rung in d.sched.ladder.control
    chunk = SchedulerConfig().scheduler.cold_chunk_tokens
    assert lanes[Lane.PREFILL].token_budget == chunk
    assert sum(len(s.token_ids) for s in lanes[Lane.PREFILL].seqs) == chunk
    assert not lanes[Lane.PREFILL].seqs[0].sample, "only the last chunk samples"


def test_with_nothing_to_decode_a_cold_prefill_takes_the_whole_device():
    d = Driver()
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    d.sched.submit(d.sched.open_session(), list(range(100, 3100)), sp)
    (plan,) = d.pump()
    assert plan.lane is Lane.PREFILL and plan.rung == d.sched.ladder.full
    d.sched.submit(d.sched.open_session(), list(range(10, 60)), sp)  # something to decode soon
    d.land()
    plans = {p.lane: p for p in d.pump()}
    assert plans[Lane.PREFILL].rung == plans[Lane.DECODE].rung in d.sched.ladder.control


def _with_scheduler(d: Driver, **changes) -> None:
    cfg = d.sched.config
    d.sched.config = dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, **changes))
    d.sched.policy.config = d.sched.config


@pytest.mark.parametrize("mode", ["first", "idle", "never"])
def test_with_no_cold_prefill_a_resume_takes_the_idle_prefill_lane(mode):
    d = Driver()
    _with_scheduler(d, prefill_lane_resumes=mode)
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    decoding = d.sched.submit(d.sched.open_session(), list(range(10, 60)), sp)
    d.pump()
    d.land()  # its prompt is done: it decodes now
    (decode_plan,) = d.pump()
    assert decode_plan.lane is Lane.DECODE and d.sched.requests[decoding].phase is Phase.DECODE
    resume = d.sched.submit(d.sched.open_session(), list(range(300, 360)), sp)
    assert d.sched.requests[resume].phase is Phase.RESUME
    plans = d.pump()  # the decode lane is busy: only the prefill lane is free
    if mode != "never":
        (plan,) = plans
        assert plan.lane is Lane.PREFILL and [s.seq_id for s in plan.seqs] == [resume]
        assert plan.seqs[0].sample and len(plan.seqs[0].token_ids) == 60
        full = d.sched.ladder.full
        assert decode_plan.rung == plan.rung == full, "no cold prefill: both lanes on the full rung"
        d.land()
        (after,) = d.pump()
        assert after.lane is Lane.DECODE and after.rung == full, "decode keeps the full rung beside a resume"
    else:
        assert plans == []
        d.land()
        (plan,) = d.pump()
        assert plan.lane is Lane.DECODE and {s.seq_id for s in plan.seqs} == {decoding, resume}
    d.until_finished(resume)
    d.until_finished(decoding)
    d.sched.check()


@pytest.mark.parametrize(
    ("backend", "setting", "full", "borrows"),
    [("fake", "auto", True, True), (CPU_CORES_BACKEND, "auto", False, True), (CPU_CORES_BACKEND, "auto", False, False),
     (CPU_CORES_BACKEND, "always", True, True), ("fake", "never", False, True)],
)
def test_decode_takes_the_full_rung_with_no_cold_prefill_on_sms_only_by_default(backend, setting, full, borrows):
    """auto: a GPU's decode takes every SM while no cold prefill exists; CPU decode keeps its core, so a resume
    runs at normal priority on a core of its own — on the full rung, borrowing decode's core while decode idles
    (``prefill_borrows_decode_cores``), or on decode's partitioned rung without the loan."""
    d = Driver(backend=backend)
    _with_scheduler(d, decode_full_rung_when_idle=setting, prefill_borrows_decode_cores=borrows)
    d.sched.policy = make_policy("agentserve", d.sched.config, d.sched.ladder)  # the policy reads it at start
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    decoding = d.sched.submit(d.sched.open_session(), list(range(10, 60)), sp)
    d.pump()
    d.land()
    (decode_plan,) = d.pump()
    resume = d.sched.submit(d.sched.open_session(), list(range(300, 360)), sp)
    (plan,) = d.pump()
    assert plan.lane is Lane.PREFILL and [s.seq_id for s in plan.seqs] == [resume]
    ladder = d.sched.ladder
    if full:
        assert decode_plan.rung == plan.rung == ladder.full
    elif borrows and backend == CPU_CORES_BACKEND:
        assert ladder.rungs[decode_plan.rung].partitioned and plan.rung == ladder.full
    else:
        assert decode_plan.rung == plan.rung != ladder.full and ladder.rungs[plan.rung].partitioned
    d.until_finished(resume)
    d.until_finished(decoding)
    d.sched.check()


@pytest.mark.parametrize("borrows", [True, False])
def test_a_resume_alone_on_an_idle_device_takes_every_unit(borrows):
    """Nothing decoding, the prefill lane idle: a resume takes the full rung (on a CPU both cores, where decode
    itself keeps its own core) — on the prefill lane, which borrows decode's idle core, or without the loan
    riding in the decode lane at once; the decode steps after it go back to decode's own rung."""
    d = Driver(backend=CPU_CORES_BACKEND)
    _with_scheduler(d, prefill_borrows_decode_cores=borrows)
    d.sched.policy = make_policy("agentserve", d.sched.config, d.sched.ladder)  # the policy reads it at start
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    seq = d.sched.submit(d.sched.open_session(), list(range(300, 360)), sp)
    (plan,) = d.pump()
    lane = Lane.PREFILL if borrows else Lane.DECODE
    assert plan.lane is lane and plan.rung == d.sched.ladder.full and [s.seq_id for s in plan.seqs] == [seq]
    d.land()
    (after,) = d.pump()
    assert after.lane is Lane.DECODE and after.rung != d.sched.ladder.full
    d.until_finished(seq)
    d.sched.check()


def test_decode_full_rung_setting_is_validated():
    with pytest.raises(ConfigError, match="decode_full_rung_when_idle"):
        load_config(overrides={"scheduler": {"decode_full_rung_when_idle": "sometimes"}})


@pytest.mark.parametrize(
    ("backend", "setting", "on_top"),
    [("fake", "auto", True), (CPU_CORES_BACKEND, "auto", False), (CPU_CORES_BACKEND, "always", True),
     ("fake", "never", False)],
)
def test_the_full_rung_tops_the_controllers_ladder_on_sms_only_by_default(backend, setting, on_top):
    """auto: a tightening controller may give a GPU's decode every SM; on CPU cores its decode reserve stays on
    the partitioned rungs, where each lane keeps its own cores at normal priority."""
    base = SchedulerConfig()
    config = dataclasses.replace(base, controller=dataclasses.replace(base.controller, full_rung_on_top=setting))
    sched = Scheduler("agentserve", ready(256, BS, backend=backend), config)
    ladder, ctl = sched.ladder, sched.policy.ctl
    assert ladder.partitioned and (ladder.control[ctl.top] == ladder.full) is on_top
    assert all(ladder.rungs[i].partitioned for i in ladder.control[:-1])
    assert ladder.full not in ladder.control[:-1]


@pytest.mark.parametrize(
    ("backend", "setting", "shrinks"),
    [("fake", "auto", True), (CPU_CORES_BACKEND, "auto", False), (CPU_CORES_BACKEND, "always", True),
     ("fake", "never", False)],
)
def test_a_tightening_controller_takes_b_below_its_start_on_sms_only_by_default(backend, setting, shrinks):
    """auto: on CPU cores a prefill token costs the same in any decode step, so the controller's tightening
    stops at b_prefill_init (what no-feedback holds) instead of spreading resumes over more steps."""
    base = SchedulerConfig()
    config = dataclasses.replace(base, controller=dataclasses.replace(base.controller, shrink_b_prefill=setting))
    ctl = Scheduler("agentserve", ready(256, BS, backend=backend), config).policy.ctl
    c = config.controller
    window = Window(c.window_s)
    for k in range(40):  # TPOT far above the target every period
        now = k * c.period_s
        for i in range(c.min_samples * 2):
            window.add(now - i * 1e-4, 10 * config.slo.tpot_target_ms / 1000)
        ctl.step(window, now)
    assert ctl.b_prefill == (c.b_prefill_min if shrinks else c.b_prefill_init)


@pytest.mark.parametrize("key", ["full_rung_on_top", "shrink_b_prefill"])
def test_controller_device_settings_are_validated(key):
    with pytest.raises(ConfigError, match=key):
        load_config(overrides={"controller": {key: "sometimes"}})


def _decoding_beside_a_cold_prefill(d: Driver) -> tuple[int, int]:
    """One request decoding, a 3000-token cold prefill's first chunk on the prefill lane."""
    sp = SamplingParams(max_tokens=200, ignore_eos=True)
    decoding = d.sched.submit(d.sched.open_session(), list(range(10, 60)), sp)
    d.pump()
    d.land()
    d.pump()  # decoding now
    cold = d.sched.submit(d.sched.open_session(), list(range(100, 3100)), sp)
    (chunk,) = d.pump()
    assert chunk.lane is Lane.PREFILL and [s.seq_id for s in chunk.seqs] == [cold]
    return decoding, cold


@pytest.mark.parametrize("mode, ride_after_ms, lane, waits", [
    ("first", 1000.0, Lane.PREFILL, True),  # the cold chunk ends first: the resume takes the prefill lane
    ("first", 20.0, Lane.DECODE, True),  # the cold chunk outlasts the wait: the resume rides
    ("idle", 1000.0, Lane.DECODE, False),  # rides at once (the paper's piggybacking)
    ("never", 1000.0, Lane.DECODE, False),
])
def test_a_resume_beside_a_cold_prefill_waits_for_the_prefill_lane_or_rides_in_decode(mode, ride_after_ms, lane,
                                                                                         waits):
    """While a cold chunk holds the prefill lane, a resume riding in a decode step would slow every
    decoding agent; with ``first`` it waits for the prefill lane (ahead of the next cold chunk), unless
    that takes longer than ``resume_ride_after_ms``."""
    d = Driver()
    _with_scheduler(d, prefill_lane_resumes=mode, resume_ride_after_ms=ride_after_ms, preempt_cold_chunks=False)
    decoding, cold = _decoding_beside_a_cold_prefill(d)
    resume = d.sched.submit(d.sched.open_session(), list(range(300, 360)), SamplingParams(max_tokens=5))
    arrived = d.now
    for _ in range(200):  # land steps until some plan carries the resume
        d.land()
        carrying = [p for p in d.pump() if resume in {s.seq_id for s in p.seqs}]
        if carrying:
            break
    (plan,) = carrying
    ids = [s.seq_id for s in plan.seqs]
    assert plan.lane is lane
    if lane is Lane.PREFILL:
        assert ids == [resume], "a step of the resume alone, no cold tokens"
        assert d.sched.requests[cold].num_computed < 3000, "the cold prefill was not finished first"
    else:
        assert set(ids) == {decoding, resume}
        assert d.exe.busy_until[Lane.PREFILL] > d.now, "the cold chunk still holds the prefill lane"
        waited = d.now - arrived
        assert waited >= ride_after_ms / 1e3 if waits else waited < 0.02
    for seq in (resume, cold, decoding):
        d.until_finished(seq)
    d.sched.check()


def _plans_while_resumes_arrive(d: Driver, cold: int, max_resumes: int) -> Iterator[tuple[Plan, set[int]]]:
    """Land steps and send plans while a 60-token resume arrives every third step (``max_resumes`` in all), until
    the cold prefill ``cold`` is computed; yields each plan with the resumes sent so far."""
    resumes: set[int] = set()
    for i in range(400):
        if i % 3 == 0 and len(resumes) < max_resumes:
            prompt = list(range(300 + i, 360 + i))
            resumes.add(d.sched.submit(d.sched.open_session(), prompt, SamplingParams(max_tokens=2)))
        d.land()
        for p in d.pump():
            yield p, resumes
        if d.sched.requests.get(cold) is None or d.sched.requests[cold].num_computed >= 3000:
            return


@pytest.mark.parametrize("preempt", [False, True])
def test_resumes_and_cold_chunks_take_turns_on_the_prefill_lane(preempt):
    """Resumes go before the next cold chunk, but never two resume turns running while a cold prefill waits
    (a resume step entering a chunk counts as one): a stream of resumes cannot hold it back."""
    d = Driver()  # resumes never ride: all of them take the prefill lane
    _with_scheduler(d, resume_ride_after_ms=1e6, preempt_cold_chunks=preempt)
    _, cold = _decoding_beside_a_cold_prefill(d)
    kinds = []
    for p, resumes in _plans_while_resumes_arrive(d, cold, 12):
        if p.lane is Lane.PREFILL:
            ids = {s.seq_id for s in p.seqs}
            assert ids <= resumes or ids == {cold}, "a step is resumes only or the cold chunk only"
            assert not (p.preempt and kinds and kinds[-1] != "cold"), "only a chunk sent before is entered"
            kinds.append("cold" if cold in ids else "preempt" if p.preempt else "resume")
    turns = ["resume" if k == "preempt" else k for k in kinds]
    assert "resume" in turns and kinds.count("cold") >= 3000 // d.sched.config.scheduler.cold_chunk_tokens - 1
    assert ("preempt" in kinds) == preempt
    assert all(not (a == b == "resume") for a, b in zip(turns, turns[1:], strict=False)), kinds
    d.sched.check()


@pytest.mark.parametrize("backend, max_tokens, holds", [
    (CPU_CORES_BACKEND, 128, True), (CPU_CORES_BACKEND, 59, False), (CPU_CORES_BACKEND, 0, False),
    ("fake", 128, False)])
def test_on_cpu_cores_a_prefill_step_of_short_resumes_holds_decodes_cores(backend, max_tokens, holds):
    """``Plan.hold_cores`` (where the prefill lane borrows decode's cores): the prefill lane's steps of resumes only
    (those entering a chunk included) of at most ``resume_hold_max_tokens`` tokens run on every core even while
    agents decode; longer ones, cold chunks and decode steps never hold them, nor does anything on a GPU."""
    d = Driver(backend=backend)
    _with_scheduler(d, resume_ride_after_ms=1e6, resume_hold_max_tokens=max_tokens)
    _, cold = _decoding_beside_a_cold_prefill(d)
    seen: dict[str, list[tuple[bool, int]]] = {"resume": [], "cold": [], "decode": []}
    for p, _ in _plans_while_resumes_arrive(d, cold, 8):
        kind = "decode" if p.lane is Lane.DECODE else "cold" if cold in {s.seq_id for s in p.seqs} else "resume"
        seen[kind].append((p.hold_cores, sum(len(s.token_ids) for s in p.seqs)))
    assert seen["resume"] and seen["cold"] and seen["decode"]
    assert all(held == (holds and tokens <= max_tokens) for held, tokens in seen["resume"]), seen["resume"]
    assert any(held for held, _ in seen["resume"]) == holds
    assert not any(held for held, _ in seen["cold"] + seen["decode"])
    d.sched.check()


def _assert_decode_idle_flags(d: Driver, plans: list[Plan]) -> bool:
    """Check one ``pump()``'s plans against the rule for ``Plan.decode_idle``; whether a sequence decoded."""
    busy = bool(d.sched.q.decoding or d.sched.lanes[Lane.DECODE])  # decode plans sent by that pump included
    for p in plans:
        assert p.decode_idle == (p.lane is Lane.PREFILL and not busy), (p, busy)
    return busy


@pytest.mark.parametrize("backend", [CPU_CORES_BACKEND, "fake"])
def test_a_prefill_plan_says_whether_any_sequence_decodes(backend):
    """``Plan.decode_idle``: a prefill-lane plan made while no sequence decodes and no decode plan is in flight or sent
    with it (the executor then lends decode's cores from the step's start); never one made beside a decode, nor a
    decode plan."""
    d = Driver(backend=backend)
    alone = d.sched.submit(d.sched.open_session(), list(range(5000, 6000)), SamplingParams(max_tokens=1))
    (plan,) = d.pump()
    assert plan.lane is Lane.PREFILL and plan.decode_idle
    d.until_finished(alone)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    decoding = d.sched.submit(d.sched.open_session(), list(range(10, 60)), sp)
    d.pump()
    d.land()
    d.pump()  # decoding now
    cold = d.sched.submit(d.sched.open_session(), list(range(100, 3100)), SamplingParams(max_tokens=1))
    seen = {True: 0, False: 0}  # prefill plans, by whether a sequence decoded when they were made
    for _ in range(100):
        plans = d.pump()
        seen[_assert_decode_idle_flags(d, plans)] += sum(p.lane is Lane.PREFILL for p in plans)
        if not d.pending:
            break
        d.land()
    assert seen[True] and seen[False], f"premise: chunks planned both beside the decode and after it: {seen}"
    for seq in (decoding, cold):
        d.until_finished(seq)
    d.sched.check()


def test_a_plan_entering_a_chunk_is_not_decode_idle_when_a_resume_rides_in_the_same_call():
    """On CPU cores a resume entering the cold chunk in flight is planned before the decode lane; a longer resume
    that then rides on the idle decode lane in the same call starts a burst, so the entering plan must not say that
    decode is idle."""
    d = Driver(backend=CPU_CORES_BACKEND)
    cold = d.sched.submit(d.sched.open_session(), list(range(100, 3100)), SamplingParams(max_tokens=1))
    (chunk,) = d.pump()
    assert chunk.lane is Lane.PREFILL and chunk.decode_idle
    sp = SamplingParams(max_tokens=3)
    budget = d.sched.config.scheduler.cold_chunk_tokens  # the entering plan's, filled by the first resume
    entering = d.sched.submit(d.sched.open_session(), list(range(300, 300 + budget)), sp)
    riding = d.sched.submit(d.sched.open_session(), list(range(4000, 4300)), sp)
    plans = d.pump()
    lanes = {(p.lane, p.preempt): [s.seq_id for s in p.seqs] for p in plans}
    assert lanes == {(Lane.PREFILL, True): [entering], (Lane.DECODE, False): [riding]}, lanes
    _assert_decode_idle_flags(d, plans)
    assert not any(p.decode_idle for p in plans)
    for seq in (entering, riding, cold):
        d.until_finished(seq)
    d.sched.check()


def test_a_resume_runs_inside_the_cold_chunk_in_flight_once_per_chunk():
    """With ``preempt_cold_chunks`` the waiting resumes are sent at once, in one step, to run inside the cold
    chunk holding the prefill lane (at its next layer boundary): their result comes back first and the
    chunk's later; a resume arriving after that waits for the next prefill-lane step, so a chunk is delayed
    by one resume step at most."""
    d = Driver()
    decoding, cold = _decoding_beside_a_cold_prefill(d)
    chunk, chunk_end = d.exe.running[Lane.PREFILL].step, d.exe.running[Lane.PREFILL].t_end
    sp = SamplingParams(max_tokens=3)
    waiting = [d.sched.submit(d.sched.open_session(), list(range(k, k + 60)), sp) for k in (300, 400)]
    plans = [p for p in d.pump() if p.lane is Lane.PREFILL]
    assert [([s.seq_id for s in p.seqs], p.preempt) for p in plans] == [(waiting, True)]
    assert d.exe.running[Lane.PREFILL].t_end > chunk_end, "the chunk ends later by the resumes' step"
    late = d.sched.submit(d.sched.open_session(), list(range(500, 560)), sp)
    landed = []  # prefill-lane steps, in the order their results land
    while chunk not in landed:
        d.pending.sort(key=lambda r: r.t_end)
        landed += [d.pending[0].step] if d.pending[0].lane is Lane.PREFILL else []
        d.land()
        assert not any(p.preempt for p in d.pump() if late in {s.seq_id for s in p.seqs}), "once per chunk"
    assert landed == [plans[0].step, chunk]
    for seq in (*waiting, late, cold, decoding):
        d.until_finished(seq)
    d.sched.check()


def test_a_preempting_plan_back_after_its_chunk_still_holds_the_prefill_lane():
    """The chunk may end before the preempting plan reaches the executor, which then runs it next: until its
    result is back the decode lane still sees the prefill lane busy on that rung."""
    d = Driver()
    _decoding_beside_a_cold_prefill(d)
    d.sched.submit(d.sched.open_session(), list(range(300, 360)), SamplingParams(max_tokens=3))
    (entering,) = [p for p in d.pump() if p.preempt]
    d.pending.sort(key=lambda r: r.t_end)
    chunk = next(r for r in d.pending if r.lane is Lane.PREFILL and r.step != entering.step)
    d.pending.remove(chunk)
    d.events += d.sched.on_result(chunk, d.now)  # the chunk's result first
    assert not d.sched.lanes[Lane.PREFILL] and d.sched.preempting
    assert d.sched._other_rung(Lane.DECODE) == entering.rung
    assert d.sched.stats(d.now)["lanes_busy"]["prefill"]
    while any(r.step == entering.step for r in d.pending):
        d.land()
    assert not d.sched.preempting
    d.sched.check()


@pytest.mark.parametrize("backend", [CPU_CORES_BACKEND, "fake"])
def test_with_nothing_decoding_a_resume_enters_the_chunk_on_cpu_cores_and_rides_alone_elsewhere(backend):
    """A resume arriving while a cold chunk runs and no agent decodes: on CPU cores it enters the chunk (held on every
    core), where riding alone on the idle decode lane would run it on decode's one core and take that core back from
    the chunk; on a GPU it rides at once on the decode lane's partition, beside the chunk."""
    d = Driver(backend=backend)
    cold = d.sched.submit(d.sched.open_session(), list(range(100, 3100)), SamplingParams(max_tokens=3))
    (chunk,) = d.pump()
    assert chunk.lane is Lane.PREFILL
    resume = d.sched.submit(d.sched.open_session(), list(range(300, 360)), SamplingParams(max_tokens=3))
    (plan,) = d.pump()
    assert [s.seq_id for s in plan.seqs] == [resume]
    if backend == CPU_CORES_BACKEND:
        assert plan.lane is Lane.PREFILL and plan.preempt and plan.hold_cores
    else:
        assert plan.lane is Lane.DECODE and not plan.preempt
    for seq in (resume, cold):
        d.until_finished(seq)
    d.sched.check()


@pytest.mark.parametrize("length", [60, 200])
def test_on_cpu_cores_with_nothing_decoding_a_short_resume_waits_for_the_prefill_lanes_resume_step(length):
    """A resume arriving while another resume's step holds the prefill lane and no agent decodes: one the prefill lane
    would hold every core for (at most ``resume_hold_max_tokens``) waits for that step and takes the lane next, where
    riding alone on the idle decode lane would run it on decode's one core, ~2x as long; after
    ``resume_ride_after_ms`` it rides anyway. A longer one rides at once (on the lane it would only borrow). On a GPU
    every one rides at once (the test above)."""
    d = Driver(backend=CPU_CORES_BACKEND)
    sp = SamplingParams(max_tokens=1)  # each finishes with its prefill step: nothing ever decodes
    assert d.sched.config.scheduler.resume_hold_max_tokens < 200 < d.sched.config.scheduler.cold_threshold_tokens
    first = d.sched.submit(d.sched.open_session(), list(range(300, 360)), sp)
    assert [(p.lane, [s.seq_id for s in p.seqs]) for p in d.pump()] == [(Lane.PREFILL, [first])]
    second = d.sched.submit(d.sched.open_session(), list(range(400, 400 + length)), sp)
    if length == 200:
        assert [(p.lane, [s.seq_id for s in p.seqs]) for p in d.pump()] == [(Lane.DECODE, [second])]
    else:
        assert d.pump() == [], "it waits for the prefill lane"
        d.land()
        carrying = [(p.lane, [s.seq_id for s in p.seqs], p.hold_cores) for p in d.pump()]
        assert carrying == [(Lane.PREFILL, [second], True)]
        third = d.sched.submit(d.sched.open_session(), list(range(500, 560)), sp)
        assert d.pump() == []
        d.now += d.sched.config.scheduler.resume_ride_after_ms / 1e3  # the prefill lane's step outlasts the wait
        assert [(p.lane, [s.seq_id for s in p.seqs]) for p in d.pump()] == [(Lane.DECODE, [third])]
        d.until_finished(third)
    for seq in (first, second):
        d.until_finished(seq)
    d.sched.check()


@pytest.mark.parametrize("changes", [{"preempt_cold_chunks": False}, {"prefill_lane_resumes": "idle"}])
def test_no_resume_enters_a_chunk_in_flight_when_preemption_is_off(changes):
    d = Driver()
    _with_scheduler(d, **changes)
    _decoding_beside_a_cold_prefill(d)
    d.sched.submit(d.sched.open_session(), list(range(300, 360)), SamplingParams(max_tokens=3))
    for _ in range(30):
        assert not any(p.preempt for p in d.pump())
        d.land()


def test_end_turn_while_in_flight_applies_when_the_step_returns():
    d = Driver()
    sid = d.sched.open_session()
    seq = d.sched.submit(sid, list(range(10, 60)), SamplingParams(max_tokens=100, ignore_eos=True))
    d.pump()
    d.land()
    d.pump()  # a decode step in flight
    ended = d.now
    d.sched.end_turn(seq, in_tool_call=True, now=ended)
    assert seq in d.sched.requests, "still in flight"
    d.land()
    assert d.now > ended
    assert any(e.seq_id == seq and e.finish is Finish.ABORT for e in d.events)
    session = d.sched.sessions[sid]
    assert session.holds_blocks and session.pin_deadline > d.now, "the pin: when the step is back"
    assert session.tool_started == ended, "the tool: from the turn's end (the client has the call then)"


def test_executor_error_ends_the_failed_step_with_error_and_frees_the_lane():
    d = Driver("chunked")
    seq = d.sched.submit(d.sched.open_session(), [1, 2, 3], SamplingParams(max_tokens=9, ignore_eos=True))
    (plan,) = d.pump()
    events = d.sched.on_error(ExecError("boom", step=plan.step, seq_ids=[seq]), now=d.now)
    assert [(e.seq_id, e.finish) for e in events] == [(seq, Finish.ERROR)]
    assert d.sched.counters["failed"] == 1 and d.sched.counters["aborted"] == 0
    assert d.sched.failure(seq) == "boom"
    assert d.sched.idle() and d.sched.idle_lanes()
    d.sched.check()


def test_lookahead_plans_feed_the_last_sample_and_release_after_the_last_result():
    import dataclasses

    base = SchedulerConfig()
    d = Driver("chunked")
    cfg = dataclasses.replace(base, scheduler=dataclasses.replace(base.scheduler, decode_lookahead=1))
    d.sched = Scheduler("chunked", ready(256, BS), cfg, clock=lambda: d.now)
    sid = d.sched.open_session()
    seq = d.sched.submit(sid, list(range(10, 40)), SamplingParams(max_tokens=3, ignore_eos=True))
    d.pump()
    d.land()  # prefill done: first token
    plans = d.pump()
    assert len(plans) == 2, "the decode lane gets one plan running and one queued behind it"
    assert plans[0].seqs[0].token_ids and plans[1].seqs[0].token_ids == [], "the queued one feeds the last sample"
    assert plans[1].seqs[0].start_pos == plans[0].seqs[0].start_pos + 1
    d.land()  # token 2
    (third,) = d.pump()  # queued behind the second
    assert third.seqs[0].token_ids == []
    d.land()  # token 3: max_tokens reached while the third plan is still queued
    assert any(e.seq_id == seq and e.finish is Finish.LENGTH for e in d.events)
    d.pump()
    assert seq not in d.released, "no Release while a plan holding the sequence is in flight"
    assert d.sched.kv.pool.num_used() > 0
    d.sched.check()
    d.land()  # the third plan comes back (the executor skipped the finished sequence)
    d.pump()
    outputs = [e for e in d.events if e.seq_id == seq and e.token_id >= 0]
    assert len(outputs) == 3
    assert d.released.count(seq) == 1 and d.sched.idle()
    d.sched.end_turn(seq, in_tool_call=False, now=d.now)
    assert d.sched.stats()["kv"]["used"] == 0
    d.sched.check()


def test_an_error_for_a_sequence_in_flight_wins_over_a_client_abort():
    """An abort asked for while the sequence's plan runs, then an executor error naming it: it ends once,
    with ERROR, when the plan is back."""
    d = Driver("chunked")
    seq = d.sched.submit(d.sched.open_session(), [1, 2, 3], SamplingParams(max_tokens=9, ignore_eos=True))
    d.pump()
    assert d.sched.abort(seq, d.now) == [], "in flight: the abort waits for the plan"
    assert d.sched.on_error(ExecError("boom", step=-1, seq_ids=[seq]), d.now) == []
    assert d.sched.abort(seq, d.now) == [], "a later client abort does not downgrade the error"
    d.land()
    assert [(e.seq_id, e.finish) for e in d.events if e.finished] == [(seq, Finish.ERROR)]
    assert d.sched.counters["failed"] == 1 and d.sched.counters["aborted"] == 0
    assert d.sched.failure(seq) == "boom", "the in-flight sequence named by the error keeps its reason"
    d.sched.check()


def test_a_failed_step_with_a_plan_queued_behind_it_ends_once_and_frees_after_both():
    d = Driver(lookahead=1)
    sid = d.sched.open_session("a")
    seq = d.sched.submit(sid, list(range(10, 60)), SamplingParams(max_tokens=50, ignore_eos=True))
    while not any(e.seq_id == seq and e.first for e in d.events):  # prefilled, now decoding
        d.pump()
        d.land()
    plans = d.pump()
    assert len(d.sched.lanes[Lane.DECODE]) == 2, "one decode plan running and one queued behind it"
    failed, behind = d.pending.pop(0), d.pending.pop(0)
    events = d.sched.on_error(ExecError("boom", failed.step, [seq]), d.now)
    assert [(e.seq_id, e.finish) for e in events] == [(seq, Finish.ERROR)]
    assert d.sched.failure(seq) == "boom"
    assert d.sched.schedule(d.now) == [], "no Release while the queued plan may still write its blocks"
    d.now = behind.t_end
    assert d.sched.on_result(behind, d.now) == []  # lands quietly: the request already ended
    assert [m for m in d.sched.schedule(d.now) if isinstance(m, Release)] == [Release([seq])]
    d.sched.check()
    assert plans and d.sched.on_result(behind, d.now) == [], "a result of no tracked plan is ignored"


def test_a_step_starts_constrained_sequences_only_while_their_grammars_fit_one_plan() -> None:
    """A plan travels in one ring slot: three sequences with 30 kB grammars start over several steps (each plan
    carries at most MAX_GRAMMAR_BYTES of grammar, or one grammar), and every one of them still runs to the end."""
    from agentserve.protocol.sampling import MAX_GRAMMAR_BYTES

    d = Driver()
    grammar = "g" * 30_000
    seqs = [d.sched.submit(d.sched.open_session(), list(range(10, 30)), SamplingParams(max_tokens=2, grammar=grammar))
            for _ in range(3)]
    sent: dict[int, int] = {}
    for _ in range(200):
        for plan in d.pump():
            grammars = [sp for sp in plan.seqs if sp.sampling is not None and sp.sampling.grammar]
            assert len(grammars) <= 1 or sum(len(sp.sampling.grammar) for sp in grammars) <= MAX_GRAMMAR_BYTES
            for sp in grammars:
                sent[sp.seq_id] = sent.get(sp.seq_id, 0) + 1
        if not d.pending:
            break
        d.land()
    assert sent == {s: 1 for s in seqs}
    assert all(any(e.seq_id == s and e.finished for e in d.events) for s in seqs)
