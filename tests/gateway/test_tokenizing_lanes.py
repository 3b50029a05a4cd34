"""The gateway's tokenising lanes: a short prompt never waits behind megabytes, and the long lane's backlog is
bounded (jobs here block on events: no timing)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from agentserve.gateway.errors import APIError
from agentserve.gateway.tokenizing import TokenizingLanes


def blocked(release: threading.Event, value: str):
    def job() -> str:
        assert release.wait(10)
        return value
    return job


async def until(condition, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


def test_a_short_prompt_is_tokenised_while_a_long_one_runs() -> None:
    async def main() -> None:
        lanes = TokenizingLanes(inline_bytes=100, max_waiting_bytes=1000)
        release = threading.Event()
        long = asyncio.create_task(lanes.run(500, blocked(release, "long")))
        await until(lambda: lanes.waiting == 500)
        assert await lanes.run(100, lambda: "short") == "short"  # the long one still holds its thread
        assert not long.done()
        release.set()
        assert await long == "long" and lanes.waiting == 0
        lanes.close()

    asyncio.run(main())


def test_the_long_lanes_backlog_is_bounded_but_a_request_alone_always_fits() -> None:
    async def main() -> None:
        lanes = TokenizingLanes(inline_bytes=100, max_waiting_bytes=1000)
        release = threading.Event()
        first = asyncio.create_task(lanes.run(600, blocked(release, "a")))
        second = asyncio.create_task(lanes.run(400, blocked(release, "b")))  # 1000 in all: fits, queued
        await until(lambda: lanes.waiting == 1000)
        with pytest.raises(APIError) as e:
            await lanes.run(101, lambda: "c")
        assert e.value.status == 503 and e.value.code == "busy"
        assert "max_tokenizing_bytes" in e.value.message
        release.set()
        assert (await first, await second) == ("a", "b")
        await until(lambda: lanes.waiting == 0)
        assert await lanes.run(5000, lambda: "alone") == "alone"
        lanes.close()

    asyncio.run(main())


def test_a_job_whose_client_left_counts_until_it_ends() -> None:
    """The thread cannot be stopped mid-encode: its bytes stay counted until it finishes, and a queued one that never
    started is dropped at once."""
    async def main() -> None:
        lanes = TokenizingLanes(inline_bytes=100, max_waiting_bytes=1000)
        release = threading.Event()
        ran: list[str] = []
        running = asyncio.create_task(lanes.run(300, blocked(release, "a")))
        queued = asyncio.create_task(lanes.run(200, lambda: ran.append("b")))
        await until(lambda: lanes.waiting == 500)
        running.cancel()
        queued.cancel()
        await until(lambda: lanes.waiting == 300)  # the queued job is gone, the running one is not
        release.set()
        await until(lambda: lanes.waiting == 0)
        assert ran == []
        lanes.close()

    asyncio.run(main())



def test_the_gateways_own_defaults_are_the_packaged_clients_bounds() -> None:
    """`up` passes limits.toml's [clients] bounds; a gateway started alone has the same."""
    from agentserve.gateway.backend import GatewayOptions
    from agentserve.orchestrator.limits import load_limits

    clients, gateway = load_limits(environ={}).clients, GatewayOptions(endpoint="")
    assert (gateway.tokenize_inline_bytes, gateway.max_tokenizing_bytes) == (clients.tokenize_inline_bytes,
                                                                            clients.max_tokenizing_bytes)
