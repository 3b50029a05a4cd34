"""`agentserve up` hands the engine settings to the executor process's command line, and it parses them."""

from __future__ import annotations

import inspect

from agentserve import configs
from agentserve.cli.up import _executor_args
from agentserve.executor.__main__ import parse
from agentserve.executor.process import RUNNER_OPTIONS
from agentserve.executor.runner import ModelRunner


def test_engine_settings_reach_the_model_runner() -> None:
    engine = configs.load("engine", None, {"engine": {"weights": "dense", "dtype": "float32",
                                                      "max_model_len": 256, "num_blocks": 12}}, environ={})["engine"]
    opts, _ = parse(["--run", "r", "--model", "/m", *_executor_args(engine, "cpu-cores")])
    assert opts.partition == "cpu-cores" and opts.model_dir == "/m"
    assert opts.runner == {"dtype": "float32", "weights": "dense", "kv_cache_dtype": "auto",
                           "attention_backend": "auto", "decode_step": "auto", "decode_helper": "auto",
                           "prefill_attention": "auto",
                           "device": "auto", "block_size": 16,
                           "num_blocks": 12, "max_model_len": 256, "memory_utilization": 0.9,
                           "cpu_kv_fraction": 0.5, "cpu_kv_cap_bytes": 2 * 2**30}


def test_the_kv_cache_size_settings_reach_the_runner() -> None:
    """engine.toml's gpu_memory_utilization, kv_cache_fraction and kv_cache_max_gb_cpu (read by nothing before)."""
    environ = {"AGENTSERVE_ENGINE_KV_CACHE_MAX_GB_CPU": "0.25", "AGENTSERVE_ENGINE_KV_CACHE_FRACTION": "0.125",
               "AGENTSERVE_ENGINE_GPU_MEMORY_UTILIZATION": "0.5"}
    engine = configs.load("engine", None, {}, environ=environ)["engine"]
    opts, _ = parse(["--run", "r", "--model", "/m", *_executor_args(engine, None)])
    assert (opts.runner["cpu_kv_cap_bytes"], opts.runner["cpu_kv_fraction"], opts.runner["memory_utilization"]) == (
        2**28, 0.125, 0.5)


def test_unset_engine_settings_keep_the_runner_defaults() -> None:
    opts, _ = parse(["--run", "r", "--model", "/m"])
    assert opts.runner == {}


def test_every_forwarded_option_is_a_model_runner_keyword() -> None:
    keywords = inspect.signature(ModelRunner.__init__).parameters
    assert [name for name, _ in RUNNER_OPTIONS if name not in keywords] == []


def test_the_ready_line_names_the_device_once() -> None:
    import torch

    from agentserve.executor.process import device_description

    assert device_description("cpu (2 cores)", torch.device("cpu")) == "cpu (2 cores)"
    assert device_description("cuda:0 NVIDIA H200", torch.device("cuda")) == "cuda:0 NVIDIA H200"  # --device auto
    assert device_description("cuda:1 NVIDIA H200", torch.device("cuda", 1)) == "cuda:1 NVIDIA H200"
    assert device_description("cpu (2 cores)", torch.device("cuda")) == "cuda cpu (2 cores)"  # they differ: both
