"""A raw DEALER peer of the module's ``ingress`` fixture."""

from __future__ import annotations

import pytest
import zmq


@pytest.fixture
def peer(ingress):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(ingress.endpoint)
    yield sock
    sock.close()
    ctx.term()
