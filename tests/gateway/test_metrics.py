"""``/metrics``: vLLM's names, types, labels and buckets (under ``agentserve:`` and ``vllm:``), parsed with
prometheus_client's own parser, and values that follow the requests served."""

from __future__ import annotations

import json
import subprocess
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from agentserve.gateway.metrics import ITL_BUCKETS, TTFT_BUCKETS

VLLM = {
    "num_requests_running": "gauge", "num_requests_waiting": "gauge", "kv_cache_usage_perc": "gauge",
    "time_to_first_token_seconds": "histogram", "inter_token_latency_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram", "request_queue_time_seconds": "histogram",
    "request_prefill_time_seconds": "histogram", "request_decode_time_seconds": "histogram",
    "request_prompt_tokens": "histogram", "request_generation_tokens": "histogram",
    "prompt_tokens": "counter", "generation_tokens": "counter", "request_success": "counter",
    "prefix_cache_queries": "counter", "prefix_cache_hits": "counter", "num_preemptions": "counter",
}


def scrape(url: str) -> dict:
    r = httpx.get(url + "/metrics")  # open without the API key, as scrapers expect
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def value(families: dict, name: str, sample: str, **labels: str) -> float:
    return sum(s.value for s in families[name].samples if s.name == sample and labels.items() <= s.labels.items())


def test_vllm_names_types_labels_and_buckets(http_server, openai_client) -> None:
    before = scrape(http_server.url)
    openai_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "m"}], max_tokens=5,
                                          temperature=0)
    after = scrape(http_server.url)
    for prefix in ("agentserve", "vllm"):
        for name, kind in VLLM.items():
            family = after[f"{prefix}:{name}"]
            assert family.type == kind, (prefix, name)
            assert all(s.labels.get("model_name") == "tiny" for s in family.samples), name
        ttft_le = [float(s.labels["le"]) for s in after[f"{prefix}:time_to_first_token_seconds"].samples
                   if s.name.endswith("_bucket")]
        assert ttft_le == [*TTFT_BUCKETS, float("inf")]
        itl_le = [float(s.labels["le"]) for s in after[f"{prefix}:inter_token_latency_seconds"].samples
                  if s.name.endswith("_bucket")]
        assert itl_le == [*ITL_BUCKETS, float("inf")]
        gen = f"{prefix}:generation_tokens"
        assert value(after, gen, gen + "_total") - value(before, gen, gen + "_total") == 5
        ok = f"{prefix}:request_success"
        assert value(after, ok, ok + "_total", finished_reason="length") > value(
            before, ok, ok + "_total", finished_reason="length")
        itl = f"{prefix}:inter_token_latency_seconds"
        assert value(after, itl, itl + "_count") - value(before, itl, itl + "_count") == 4
    kv = value(after, "agentserve:kv_cache_usage_perc", "agentserve:kv_cache_usage_perc")
    assert 0.0 <= kv <= 1.0


def test_preemptions_count_what_the_orchestrator_counted_across_its_restarts() -> None:
    """vLLM's ``num_preemptions_total``, from the stats each scrape reads: the orchestrator's count starts from 0
    again with a new scheduler (an executor restart), the counter never goes down."""
    from msgspec.structs import replace

    from agentserve.gateway.metrics import Metrics
    from agentserve.protocol.stats import Kv, Snapshot

    metrics = Metrics("m", 4096, ["vllm"])
    for seen in (0, 3, 5, 5, 2):  # 5 preemptions, a restart, 2 more
        metrics.on_snapshot(replace(Snapshot(), kv=Kv(total_blocks=8, preemptions=seen)), 0)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    for prefix in ("agentserve", "vllm"):
        name = f"{prefix}:num_preemptions"
        assert value(families, name, name + "_total") == 7


def test_ttft_by_class_and_agentserve_gauges(http_server, openai_client) -> None:
    name = "agentserve:time_to_first_token_by_class_seconds"
    before = scrape(http_server.url)
    messages = [{"role": "user", "content": "first"}]
    r1 = openai_client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0)
    messages += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "on"}]
    openai_client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0)
    after = scrape(http_server.url)
    for cls in ("cold", "resume"):
        grew = value(after, name, name + "_count", **{"class": cls}) - value(before, name, name + "_count",
                                                                                **{"class": cls})
        assert grew == 1, cls
    for gauge in ("agentserve:controller_b_prefill_tokens", "agentserve:controller_r_min_rung",
                  "agentserve:partition_rung", "agentserve:kv_pinned_blocks", "agentserve:lane_utilisation"):
        assert after[gauge].type == "gauge" and after[gauge].samples, gauge
    lanes = {s.labels["lane"] for s in after["agentserve:lane_utilisation"].samples}
    assert lanes == {"decode", "prefill"}
    requests = after["agentserve:http_requests"]
    assert any(s.labels == {"model_name": "tiny", "path": "/v1/chat/completions", "status": "200"}
               for s in requests.samples)


def test_prefix_cache_tokens_by_class(http_server, openai_client) -> None:
    """A continued conversation's prompt is counted under `resume` with most of it cached; a new one under
    `cold`; the class counters add up to the all-request ones."""
    before = scrape(http_server.url)
    messages = [{"role": "user", "content": "by class " * 30}]
    r1 = openai_client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0)
    messages += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "go"}]
    r2 = openai_client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0)
    after = scrape(http_server.url)

    def grew(name: str, **labels: str) -> float:
        family = f"agentserve:{name}"
        return value(after, family, family + "_total", **labels) - value(before, family, family + "_total", **labels)

    assert grew("prefix_cache_queries_by_class", **{"class": "cold"}) == r1.usage.prompt_tokens
    assert grew("prefix_cache_queries_by_class", **{"class": "resume"}) == r2.usage.prompt_tokens
    assert grew("prefix_cache_hits_by_class", **{"class": "resume"}) == r2.usage.prompt_tokens_details.cached_tokens
    assert r2.usage.prompt_tokens_details.cached_tokens > 0.8 * r2.usage.prompt_tokens  # the first turn was held
    for kind in ("queries", "hits"):
        by_class = grew(f"prefix_cache_{kind}_by_class")
        assert by_class == grew(f"prefix_cache_{kind}")


def test_top_shows_the_gateway(http_server, openai_client) -> None:
    openai_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    out = subprocess.run(["agentserve", "top", "--run", http_server.run, "--once", "--json"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    snap = json.loads(out)
    assert snap["server"]["http"] == http_server.url
    gateway = snap["gateway"]
    assert gateway["reachable"] and gateway["url"] == http_server.url and gateway["requests_total"] >= 1


def test_completions_are_counted_like_chat(http_server, openai_client) -> None:
    """`/v1/completions` turns feed the same request metrics, a continued token prompt under `resume`."""
    before = scrape(http_server.url)
    r1 = openai_client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=3, temperature=0,
                                          extra_body={"return_token_ids": True})
    prompt = [5, 6, 7, 8, *r1.choices[0].token_ids, 9]
    openai_client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    after = scrape(http_server.url)

    def grew(name: str, sample: str, **labels: str) -> float:
        family = f"vllm:{name}"
        return value(after, family, family + sample, **labels) - value(before, family, family + sample, **labels)

    assert grew("generation_tokens", "_total") == 7
    assert grew("prompt_tokens", "_total") == 4 + len(prompt)
    assert grew("e2e_request_latency_seconds", "_count") == 2
    assert grew("inter_token_latency_seconds", "_count") == 2 + 3
    assert grew("request_success", "_total", finished_reason="length") == 2
    assert value(after, "agentserve:conversation_map_sessions", "agentserve:conversation_map_sessions") >= 1
    by_class = "agentserve:time_to_first_token_by_class_seconds"
    for cls in ("cold", "resume"):
        assert value(after, by_class, by_class + "_count", **{"class": cls}) - value(
            before, by_class, by_class + "_count", **{"class": cls}) == 1, cls


def test_a_refused_turn_is_not_counted_as_an_abort(http_server, http) -> None:
    """A turn the orchestrator refuses before it starts is an HTTP error, not a finished request: neither endpoint
    counts it under `request_success{finished_reason="abort"}`."""
    ok = "agentserve:request_success"
    before = value(scrape(http_server.url), ok, ok + "_total", finished_reason="abort")
    assert http.post("/v1/completions", json={"prompt": [10**6], "max_tokens": 2}).status_code == 400
    body = {"messages": [{"role": "user", "content": "many words " * 20_000}], "max_tokens": 2}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert value(scrape(http_server.url), ok, ok + "_total", finished_reason="abort") == before


def open_streams(url: str) -> float:
    name = "agentserve:http_open_streams"
    return value(scrape(url), name, name)


def test_every_streamed_endpoint_counts_as_an_open_stream(http_server, http) -> None:
    """`http_open_streams` counts `/v1/completions` streams as it counts chat's, and drops once a client goes."""
    bodies = {"/v1/completions": {"prompt": "open", "max_tokens": 2000, "ignore_eos": True, "stream": True},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "open"}], "max_tokens": 2000,
                                       "ignore_eos": True, "stream": True}}
    for path, body in bodies.items():
        before = open_streams(http_server.url)
        with http.stream("POST", path, json=body) as r:
            lines = r.iter_lines()  # kept: a dropped iterator closes the connection
            next(lines)
            assert open_streams(http_server.url) == before + 1, path
        deadline = time.monotonic() + 10
        while open_streams(http_server.url) != before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert open_streams(http_server.url) == before, path
