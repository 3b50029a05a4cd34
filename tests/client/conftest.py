from __future__ import annotations

import pytest
from agent_fake_server import EchoServer


@pytest.fixture
def endpoint(tmp_path):
    return f"ipc://{tmp_path}/as.sock"


@pytest.fixture
def server(endpoint):
    with EchoServer(endpoint) as srv:
        yield srv


@pytest.fixture
def slow_server(endpoint):
    with EchoServer(endpoint, token_delay_s=0.02) as srv:
        yield srv
