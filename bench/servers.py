"""Start and stop the systems under test: a fresh ``agentserve up`` per policy, or llama.cpp's server.

Each launcher is a context manager that yields a connected-ready :class:`Target` (how to build the
driver) and stops the process on exit (SIGTERM, then SIGKILL after a grace period); the process runs in its own
session, so a Ctrl-C reaches bench alone, and gets SIGTERM if bench dies without stopping it. Server output
goes to a log file whose tail is quoted when the server fails to start, and which is copied to ``keep_log`` when
the server has stopped (``agentserve bench --keep-logs``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from agentserve import configs
from agentserve.bench.driver import Driver
from agentserve.bench.http_sse import get
from agentserve.bench.openai_driver import OpenAIDriver
from agentserve.bench.sdk_driver import SDKDriver
from agentserve.cli.child_process import own_session

LLAMA_CACHE = configs.cache_dir("AGENTSERVE_LLAMA_CACHE", "llama.cpp")


class ServerFailed(RuntimeError):
    pass


@dataclass
class Target:
    name: str
    make_driver: Callable[[], Driver]


def _tail(log: Path, n: int = 30) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _stop(proc: subprocess.Popen, grace_s: float = 30.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


@contextlib.contextmanager
def _process(cmd: list[str], ready: Callable[[subprocess.Popen, Path], bool], timeout_s: float,
             env: dict[str, str] | None = None, keep_log: Path | None = None) -> Iterator[subprocess.Popen]:
    workdir = Path(tempfile.mkdtemp(prefix="agentserve-bench-"))
    log = workdir / "server.log"
    with log.open("wb") as out:
        # its own session: only bench stops it (a Ctrl-C in the terminal would reach it too, then bench's SIGTERM)
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, **own_session())
    try:
        deadline = time.monotonic() + timeout_s
        while not ready(proc, log):
            if proc.poll() is not None:
                raise ServerFailed(f"{cmd[0]} exited with {proc.returncode} before it was ready:\n"
                                   f"{_tail(log)}")
            if time.monotonic() > deadline:
                raise ServerFailed(f"{cmd[0]} not ready after {timeout_s:.0f} s:\n{_tail(log)}")
            time.sleep(0.2)
        yield proc
    finally:
        rc = _stop(proc)
        if rc not in (0, -signal.SIGTERM):
            print(f"warning: {cmd[0]} exited with {rc}:\n{_tail(log, 10)}", file=sys.stderr)
        if keep_log is not None:
            keep(log, keep_log)
        shutil.rmtree(workdir, ignore_errors=True)


def keep(log: Path, to: Path) -> Path | None:
    """Copy a stopped server's log to ``to`` (its folder made as needed), or to ``STEM-2.log``, ``STEM-3.log``, …
    where that name is taken; returns where it went.  A failure is a warning, not an error."""
    try:
        to.parent.mkdir(parents=True, exist_ok=True)
        n, free = 1, to
        while free.exists():
            n += 1
            free = to.with_name(f"{to.stem}-{n}{to.suffix}")
        shutil.copyfile(log, free)
        return free
    except OSError as e:
        print(f"warning: could not keep the server log as {to}: {e}", file=sys.stderr)
        return None


def agentserve_command(model: str, policy: str, endpoint: str, extra: list[str]) -> list[str]:
    """The command line of one AgentServe server (adapt here if ``agentserve up`` changes)."""
    exe = Path(sys.executable).with_name("agentserve")
    run = f"bench{os.getpid()}-{policy}"  # its own shared-memory names, whatever else runs here
    return [str(exe) if exe.is_file() else "agentserve", "up", "--model", model, "--policy", policy,
            "--endpoint", endpoint, "--run", run, *extra]


@contextlib.contextmanager
def agentserve(model: str, policy: str, extra: list[str] | None = None,
               timeout_s: float = 600.0, keep_log: Path | None = None) -> Iterator[Target]:
    """A fresh ``agentserve up`` with ``policy``; ready once it prints a line with "ready" and its endpoint."""
    sock_dir = Path(tempfile.mkdtemp(prefix="agentserve-bench-ipc-"))
    endpoint = f"ipc://{sock_dir}/ingress.sock"
    ready = lambda proc, log: any(endpoint in line and "ready" in line.lower()
                                  for line in log.read_text(errors="replace").splitlines())
    try:
        with _process(agentserve_command(model, policy, endpoint, extra or []), ready, timeout_s, keep_log=keep_log):
            yield Target(policy, lambda: SDKDriver(endpoint, name=policy))
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        return asyncio.run(get(url + "/health"))[0] == 200
    except OSError:
        return False


def llama_paths(model: str) -> tuple[Path, Path]:
    """llama-server binary and the model's GGUF (``AGENTSERVE_LLAMA_SERVER`` / ``AGENTSERVE_LLAMA_GGUF``)."""
    binary = Path(os.environ.get("AGENTSERVE_LLAMA_SERVER", LLAMA_CACHE / "bin/llama-server"))
    gguf = Path(os.environ.get("AGENTSERVE_LLAMA_GGUF", LLAMA_CACHE / f"models/{Path(model).name}.gguf"))
    if not binary.is_file():
        raise ServerFailed(f"no llama-server at {binary}: run scripts/compare_llamacpp.sh --build-only")
    if not gguf.is_file():
        from agentserve.bench.gguf_export import export
        from agentserve.executor.builtin import resolve_model

        export(resolve_model(model), gguf)
    return binary, gguf


def ascii_only_bias(model: str) -> dict:
    """For the random-weight built-in models: ban every non-ASCII token in llama.cpp.

    Their byte-level output is mostly invalid UTF-8, and llama-server holds back streamed tokens
    until the text is complete UTF-8 (tens of tokens, then one burst), which would bill llama.cpp
    for an artefact of random weights. Banning ids >= 128 keeps the work the same (fixed length)
    and makes every token stream as soon as it is sampled. Real checkpoints are left alone.
    """
    from agentserve.executor.builtin import BUILTINS, vocab_size

    if model not in BUILTINS:
        return {}
    return {"logit_bias": [[i, False] for i in range(128, vocab_size())]}


@contextlib.contextmanager
def llama_server(model: str, slots: int, ctx_per_slot: int, timeout_s: float = 300.0,
                 keep_log: Path | None = None) -> Iterator[Target]:
    """llama.cpp's ``llama-server`` on 127.0.0.1 with ``slots`` parallel slots, the same weights as GGUF.

    ``AGENTSERVE_LLAMA_ARGS`` adds arguments (e.g. ``-t 1``).
    """
    binary, gguf = llama_paths(model)
    url = f"http://127.0.0.1:{_free_port()}"
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1],
           "-np", str(slots), "-c", str(slots * ctx_per_slot), "--no-webui",
           *os.environ.get("AGENTSERVE_LLAMA_ARGS", "").split()]
    extra = ascii_only_bias(model)
    with _process(cmd, lambda proc, log: _healthy(url), timeout_s, keep_log=keep_log):
        yield Target("llama-server", lambda: OpenAIDriver(url, dialect="llamacpp", name="llama-server",
                                                          extra_body=extra))


@contextlib.contextmanager
def external(url: str, dialect: str = "openai", model: str | None = None) -> Iterator[Target]:
    """A server someone else runs (``--target``); nothing to start or stop."""
    yield Target("target", lambda: OpenAIDriver(url, dialect=dialect, model=model, name="target"))
