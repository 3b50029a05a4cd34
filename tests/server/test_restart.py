"""After an executor crash the loop keeps serving while the new executor loads: turns are refused with
``executor_failed`` ("restarting") at once, sessions stay open, and turns run again once it is ready."""

from __future__ import annotations

import pytest
from server_harness import TOKEN, serving, wait_until

from agentserve.client import AgentClient
from agentserve.client.errors import ExecutorFailed
from agentserve.orchestrator.executor_link import ExecutorDown, Restarted


def test_turns_are_refused_while_the_executor_restarts_then_served_again(tmp_path) -> None:
    with (serving(tmp_path) as (endpoint, link, server), AgentClient(endpoint) as client,
          client.session(system="sys") as s):
        assert s.turn("before", max_tokens=2, ignore_eos=True).collect().token_ids == [TOKEN] * 2
        link.post(ExecutorDown("executor died: test"))
        wait_until(lambda: link.restarts == 1)
        with pytest.raises(ExecutorFailed, match="restarting"):
            s.turn("during", max_tokens=2, ignore_eos=True).collect()
        with client.session(system="other") as t:  # the loop still serves everything but turns
            assert t.id != s.id
        link.post(Restarted(link.ready))
        wait_until(lambda: not server.restarting)
        again = s.turn("after", max_tokens=3, ignore_eos=True).collect()
        assert again.token_ids == [TOKEN] * 3
