"""A turn's timings: its wait for a first step (``queue_ms``) is part of its TTFT, and measured (it was always 0,
so the HTTP front's queue-time histogram stayed empty and its prefill time was arrival → first token)."""

from __future__ import annotations

from server_harness import serving

from agentserve.client import AgentClient


def test_a_turns_queue_time_is_measured_and_within_its_ttft(tmp_path) -> None:
    with serving(tmp_path) as (endpoint, _, _), AgentClient(endpoint) as client, client.session() as s:
        for _ in range(3):
            timings = s.turn(token_ids=[5, 6, 7], max_tokens=3, ignore_eos=True).collect().done.timings
            assert 0 < timings.queue_ms <= timings.ttft_ms <= timings.e2e_ms, timings
