"""Drive an ingress and a raw peer from one thread."""

from __future__ import annotations

import time

from agentserve.protocol.client_messages import ClientCodec

codec = ClientCodec()


def pump(ingress, until, timeout=5.0):
    """Poll the ingress until ``until(collected)`` holds; return what poll() returned."""
    got = []
    deadline = time.monotonic() + timeout
    while not until(got) and time.monotonic() < deadline:
        got.extend(ingress.poll(20))
    return got


def reply(ingress, peer, timeout=5.0):
    """The next event the peer receives (liveness probes skipped), polling the ingress meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ingress.poll(10)
        if peer.poll(10):
            payload = peer.recv()
            if payload:
                return codec.decode(payload)
    raise AssertionError("no reply")
