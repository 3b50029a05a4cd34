"""The prompt worker: every job yields one ``Done`` in order, whatever it raises, and the bytes it held for its owner
are released when that ``Done`` is drained."""

from __future__ import annotations

import select

from agentserve.orchestrator.prompt_worker import PromptWorker


class Panic(BaseException):
    """Like pyo3's PanicException, which a Rust tokenizer raises when it panics: not an ``Exception``."""


def _drain(worker: PromptWorker, n: int) -> list:
    out: list = []
    while len(out) < n:
        assert select.select([worker.fileno()], [], [], 10)[0], "no Done within 10 s"
        out += worker.drain()
    return out


def test_every_job_yields_one_done_and_releases_its_bytes() -> None:
    worker = PromptWorker()
    try:
        def panic():
            raise Panic("tokenizer panicked")

        worker.submit("ok", lambda: 1, b"a", 100)
        worker.submit("bad", lambda: {}["missing"], b"a", 200)
        worker.submit("panic", panic, b"b", 300)
        worker.submit("after", lambda: 2, b"b", 400)
        assert (worker.held(b"a"), worker.held(b"b")) == (300, 700)  # until drained, done or not
        done = _drain(worker, 4)
        assert [d.key for d in done] == ["ok", "bad", "panic", "after"]
        assert done[0].result == 1 and isinstance(done[1].error, KeyError)
        assert isinstance(done[2].error, RuntimeError) and "Panic: tokenizer panicked" in str(done[2].error)
        assert done[3].result == 2, "the thread lives on after a panic"
        assert worker.held(b"a") == worker.held(b"b") == 0 and worker.pending == 0
    finally:
        worker.close()
