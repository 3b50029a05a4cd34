"""The SGLang worker endpoints a router calls (``/server_info``, ``/model_info``, ``/get_load``,
``/flush_cache``, ``/health_generate``), against the shared ``agentserve up --http`` server and, for the
not-yet-connected case, an app whose orchestrator does not exist."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from starlette.testclient import TestClient

from agentserve.gateway.app import build_app
from agentserve.gateway.backend import GatewayOptions
from agentserve.gateway.worker_routes import load_of
from agentserve.protocol.stats import Kv, SessionRow, SessionState, Snapshot

from .test_metrics import scrape, value


def test_server_info_names_the_model_and_the_kv_capacity(http_server, http) -> None:
    snap = http_server.snapshot()
    for path in ("/server_info", "/get_server_info"):
        info = http.get(path).json()
        assert info["served_model_name"] == "tiny"
        assert (Path(info["model_path"]) / "config.json").is_file()
        assert info["dp_size"] == 1
        assert info["max_total_tokens"] == snap.kv.total_blocks * snap.kv.block_size == 1024 * snap.kv.block_size
        assert info["context_length"] == info["max_model_len"] == 4096


def test_model_info_comes_from_the_checkpoint_config(http) -> None:
    first = http.get("/model_info").json()
    config = json.loads((Path(first["model_path"]) / "config.json").read_text())
    for path in ("/model_info", "/get_model_info"):
        info = http.get(path).json()
        assert info["is_generation"] is True
        assert info["model_type"] == config["model_type"]
        assert info["architectures"] == config["architectures"]


def test_get_load_counts_a_running_request_and_its_kv(http_server, http) -> None:
    """Polled while a 3,000-token prompt is prefilled and decoded: the request and its KV show up."""
    idle = http.get("/get_load").json()
    assert isinstance(idle, list) and len(idle) == 1 and idle[0]["dp_rank"] == 0
    prompt = [10 + (i * 7) % 240 for i in range(3000)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1000, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(http.post, "/v1/completions", json=body)
        seen = []
        while not answer.done():
            seen.append(http.get("/get_load").json()[0])
    assert answer.result().status_code == 200
    busiest = max(seen, key=lambda load: load["num_reqs"])
    assert busiest["num_reqs"] >= 1, seen
    most = max(load["num_tokens"] for load in seen)
    assert most >= 3000 and most > idle[0]["num_tokens"], (most, idle)  # the prompt's KV is in use


def test_flush_cache_closes_the_idle_conversations(http_server, http) -> None:
    messages = [{"role": "user", "content": "flush me " * 20}]
    reply = http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 4,
                                                     "temperature": 0}).json()
    assert value(scrape(http_server.url), "agentserve:conversation_map_sessions",
                 "agentserve:conversation_map_sessions") >= 1
    answer = http.post("/flush_cache")
    assert answer.status_code == 200 and answer.json()["closed_sessions"] >= 1
    after_flush = scrape(http_server.url)
    assert value(after_flush, "agentserve:conversation_map_sessions", "agentserve:conversation_map_sessions") == 0
    continued = value(after_flush, "agentserve:conversation_continuations",
                      "agentserve:conversation_continuations_total")
    messages += [reply["choices"][0]["message"], {"role": "user", "content": "and now?"}]
    again = http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 4})
    assert again.status_code == 200
    assert value(scrape(http_server.url), "agentserve:conversation_continuations",
                 "agentserve:conversation_continuations_total") == continued  # a new session, not a resume


def test_health_generate_runs_a_token_without_the_api_key(http_server) -> None:
    assert httpx.get(http_server.url + "/health_generate", timeout=30).status_code == 200
    assert httpx.get(http_server.url + "/server_info").status_code == 401  # the others need the key
    assert httpx.post(http_server.url + "/flush_cache").status_code == 401


def test_every_worker_route_is_503_until_the_orchestrator_answers(tmp_path) -> None:
    app = build_app(GatewayOptions(endpoint=f"ipc://{tmp_path}/nobody.sock"))
    with TestClient(app) as client:
        for method, path in [("GET", "/server_info"), ("GET", "/model_info"), ("GET", "/get_load"),
                             ("POST", "/flush_cache"), ("GET", "/health_generate")]:
            answer = client.request(method, path)
            assert answer.status_code == 503, (path, answer.text)
            assert answer.json()["error"]["code"] == "unavailable"


def test_load_of_counts_running_and_waiting_sessions() -> None:
    rows = [SessionRow(id=1, state=SessionState.DECODING), SessionRow(id=2, state=SessionState.QUEUED),
            SessionRow(id=3, state=SessionState.PREFILLING), SessionRow(id=4, state=SessionState.IN_TOOL),
            SessionRow(id=5, state=SessionState.IDLE)]
    snap = Snapshot(sessions=rows, kv=Kv(used_blocks=7, total_blocks=100, block_size=16))
    assert load_of(snap) == [{"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 2, "num_tokens": 112}]
