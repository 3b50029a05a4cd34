"""User config files and AGENTSERVE_* variables: typos, wrong types and bad values are one-line ConfigErrors.

A ``--config`` file is read by every loader of ``agentserve up`` (engine, scheduler + SLO, limits), each
taking its own sections, so a section or key is unknown only when no packaged file has it.
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
from click.testing import CliRunner

from agentserve import configs
from agentserve.cli.engine_options import engine_config
from agentserve.cli.up import up
from agentserve.configs import ConfigError
from agentserve.orchestrator.limits import ServingLimits, load_limits
from agentserve.orchestrator.scheduler.config import SchedulerConfig, load_config
from agentserve.protocol.limits import Limits

LOADERS = {
    "engine": lambda f, env: engine_config(f, {}),
    "scheduler": lambda f, env: load_config(f, environ=env),
    "limits": lambda f, env: load_limits(f, environ=env),
    "fleet": lambda f, env: configs.load("fleet", f, environ=env),
}
NO_MODEL = "/nonexistent/model"  # were the file not refused, `up` would stop at the model at once, not serve


@pytest.fixture
def user(tmp_path, monkeypatch):
    for name in [n for n in os.environ if n.startswith(configs.ENV_PREFIX)]:
        monkeypatch.delenv(name)

    def write(text: str):
        path = tmp_path / "mine.toml"
        path.write_text(text)
        return path

    return write


# ---- 1. wrongly typed values --------------------------------------------------------------------


@pytest.mark.parametrize(("text", "where", "expected"), [
    ('[slo]\ntpot_target_ms = "fast"\n', "[slo] tpot_target_ms", "a number"),
    ('[controller]\nperiod_s = "x"\n', "[controller] period_s", "a number"),
    ("[scheduler]\nmax_batch_seqs = 1.5\n", "[scheduler] max_batch_seqs", "an integer"),
    ("[scheduler]\ncold_chunk_tokens = true\n", "[scheduler] cold_chunk_tokens", "an integer"),
    ("[scheduler]\npreempt_cold_chunks = 1\n", "[scheduler] preempt_cold_chunks", "a boolean"),
    ("[controller]\nfull_rung_on_top = 1\n", "[controller] full_rung_on_top", "a string"),
    ('[clients]\nstall_timeout_s = "3"\n', "[clients] stall_timeout_s", "a number"),
    ('[request]\nmax_messages = "many"\n', "[request] max_messages", "an integer"),
    ('[engine]\nblock_size = "16"\n', "[engine] block_size", "an integer"),
    ('[fleet]\nworkers = "2"\n', "[fleet] workers", "an integer"),
])
def test_a_wrongly_typed_value_names_its_section_key_and_type(user, text, where, expected):
    path = user(text)
    for load in LOADERS.values():
        with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}: \[.*{expected}") as e:
            load(path, {})
        assert where in str(e.value)


def test_an_int_is_a_float_where_a_float_is_expected(user):
    cfg = load_config(user("[slo]\ntpot_target_ms = 80\n[controller]\nperiod_s = 1\n"), environ={})
    assert cfg.slo.tpot_target_ms == 80.0 and isinstance(cfg.slo.tpot_target_ms, float)
    assert cfg.controller.period_s == 1.0
    assert load_limits(user("[executor]\nhang_floor_s = 5\n"), environ={}).executor.hang_floor_s == 5.0


def test_dicts_built_in_code_are_checked_too():
    with pytest.raises(ConfigError, match=r"\[slo\] tpot_target_ms: expected a number, got str 'fast'"):
        load_config(overrides={"slo": {"tpot_target_ms": "fast"}}, environ={})
    with pytest.raises(ConfigError, match=r"\[kv\] retain_on_tool_call: expected a boolean"):
        SchedulerConfig.from_dict({"kv": {"retain_on_tool_call": "yes"}})
    with pytest.raises(ConfigError, match=r"\[clients\] send_hwm: expected an integer"):
        ServingLimits.from_dict({"clients": {"send_hwm": "64"}})


def test_up_reports_a_wrong_type_in_one_line_and_exits_2(user):
    res = CliRunner().invoke(up, ["--model", NO_MODEL, "--config", str(user('[slo]\ntpot_target_ms = "fast"\n'))])
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    assert "[slo] tpot_target_ms: expected a number, got str 'fast'" in res.output
    assert "Traceback" not in res.output


# ---- 2. typos: sections and keys no packaged file has --------------------------------------------


@pytest.mark.parametrize(("text", "message"), [
    ('[engin]\nmodel = "bench"\n', r"unknown section \[engin\] \(did you mean 'engine'\?\)"),
    ('[engine]\nmodle = "bench"\n', r"unknown key \[engine\] modle \(did you mean 'model'\?\)"),
    ('[scheduler]\npolicyy = "x"\n', r"unknown key \[scheduler\] policyy"),
    ("[request]\nmax_frame_bytez = 1\n", r"unknown key \[request\] max_frame_bytez"),
    ("[slo]\ntpot_target = 1.0\n", r"unknown key \[slo\] tpot_target"),
    ("[fleet]\nworker = 3\n", r"unknown key \[fleet\] worker"),
    ('model = "bench"\n', r"unknown key 'model' outside any section"),
    ("engine = 3\n", r"engine must be a \[engine\] table"),
])
def test_every_loader_refuses_what_no_packaged_file_has(user, text, message):
    path = user(text)
    for name, load in LOADERS.items():
        with pytest.raises(ConfigError, match=message) as e:
            load(path, {})
        assert "unexpected keyword" not in str(e.value), name


def test_one_file_may_hold_the_sections_of_every_file(user):
    path = user('[engine]\nmodel = "bench"\n[scheduler]\npolicy = "fcfs"\n[slo]\ntpot_target_ms = 80.0\n'
                "[request]\nmax_stop_strings = 2\n[clients]\nsend_hwm = 8\n[fleet]\nworkers = 3\n"
                '[router]\nrequest_timeout_secs = 30\nanything_the_router_takes = "x"\n')
    assert engine_config(str(path), {})["model"] == "bench"
    cfg = load_config(path, environ={})
    assert (cfg.scheduler.policy, cfg.slo.tpot_target_ms) == ("fcfs", 80.0)
    limits = load_limits(path, environ={})
    assert limits.request == Limits(max_stop_strings=2) and limits.clients.send_hwm == 8
    fleet = configs.load("fleet", path, environ={})
    assert fleet["fleet"]["workers"] == 3
    assert fleet["router"]["request_timeout_secs"] == 30 and fleet["router"]["anything_the_router_takes"] == "x"


def test_up_reports_a_typo_in_one_line_and_exits_2(user):
    res = CliRunner().invoke(up, ["--model", NO_MODEL, "--config", str(user('[engine]\nmodle = "bench"\n'))])
    assert res.exit_code == 2, res.output
    assert "unknown key [engine] modle" in res.output and "Traceback" not in res.output


def test_the_packaged_files_and_the_dataclasses_have_the_same_keys():
    """The union check reads the packaged files, the loaders the dataclasses: they must agree."""
    known = configs.known_settings()
    for section in dataclasses.fields(SchedulerConfig):
        assert set(known[section.name]) == {f.name for f in dataclasses.fields(section.default_factory)}  # type: ignore[arg-type]
    for section in dataclasses.fields(ServingLimits):
        assert set(known[section.name]) == {f.name for f in dataclasses.fields(section.default_factory)}  # type: ignore[arg-type]


# ---- 3. variables that do not parse ---------------------------------------------------------------


@pytest.mark.parametrize(("name", "value", "expected"), [
    ("AGENTSERVE_SLO_TPOT_TARGET_MS", "abc", "a number"),
    ("AGENTSERVE_SCHEDULER_MAX_BATCH_SEQS", "1.5", "an integer"),
    ("AGENTSERVE_KV_RETAIN_ON_TOOL_CALL", "maybe", "a boolean"),
    ("AGENTSERVE_CLIENTS_SEND_HWM", "lots", "an integer"),
])
def test_a_variable_that_does_not_parse_is_named_with_its_value(name, value, expected):
    for load in (lambda env: load_config(environ=env), lambda env: load_limits(environ=env)):
        try:
            load({name: value})
        except ConfigError as e:
            assert f"{name}={value!r}" in str(e) and expected in str(e)
            break
    else:
        pytest.fail(f"{name}={value} was accepted")


def test_an_engine_variable_that_does_not_parse_is_named(monkeypatch):
    monkeypatch.setenv("AGENTSERVE_ENGINE_BLOCK_SIZE", "abc")
    with pytest.raises(ConfigError, match=r"AGENTSERVE_ENGINE_BLOCK_SIZE='abc': expected an integer"):
        engine_config(None, {})


def test_booleans_from_variables():
    assert load_config(environ={"AGENTSERVE_KV_RETAIN_ON_TOOL_CALL": "off"}).kv.retain_on_tool_call is False
    assert load_config(environ={"AGENTSERVE_KV_RETAIN_ON_TOOL_CALL": "Yes"}).kv.retain_on_tool_call is True


# ---- 4. variables for keys no packaged file has ---------------------------------------------------


def test_router_variables_for_any_router_option_are_taken():
    env = {"AGENTSERVE_ROUTER_REQUEST_TIMEOUT_SECS": "30", "AGENTSERVE_ROUTER_ENABLE_IGW": "true",
           "AGENTSERVE_ROUTER_CACHE_THRESHOLD": "0.5", "AGENTSERVE_ROUTER_POLICY": "round_robin"}
    router = configs.load("fleet", environ=env)["router"]
    assert router["request_timeout_secs"] == "30"  # passed on as `--request-timeout-secs 30`
    assert router["enable_igw"] is True  # a bare flag
    assert (router["cache_threshold"], router["policy"]) == (0.5, "round_robin")  # known keys: their own type


def test_variables_for_unknown_keys_elsewhere_are_left_alone():
    env = {"AGENTSERVE_FLEET_NOT_A_KEY": "1", "AGENTSERVE_SLO_NOT_A_KEY": "x", "AGENTSERVE_NOTHING": "y"}
    assert configs.load("fleet", environ=env)["fleet"] == configs.packaged("fleet")["fleet"]
    assert load_config(environ=env) == load_config(environ={})
