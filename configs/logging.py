"""Structured logs for every AgentServe process (stdlib ``logging``).

One line per record, either ``key=value`` pairs or a JSON object, always with ``ts``, ``level``,
``logger``, ``process`` (the process name) and ``msg``, plus any ``extra={...}`` fields::

    log.info("step done", extra={"step": 12})
    ts=2026-01-01T12:00:00.123Z level=INFO logger=agentserve.executor process=executor msg="step done" step=12
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import IO, Any

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    ts = datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds")
    out: dict[str, Any] = {
        "ts": ts.replace("+00:00", "Z"),
        "level": record.levelname,
        "logger": record.name,
        "process": record.processName,
        "msg": record.getMessage(),
    }
    out |= {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}
    if record.exc_info:
        out["exc"] = logging.Formatter().formatException(record.exc_info)
    return out


def _kv_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if text == "" or any(c in text for c in ' ="\n'):
        return json.dumps(text)
    return text


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record), default=str, ensure_ascii=False)


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={_kv_value(v)}" for k, v in _fields(record).items())


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL", "WARN", "FATAL", "NOTSET")  # the names logging takes


def setup_logging(level: str | int = "INFO", json: bool = False, stream: IO[str] | None = None) -> None:
    """Configure the root logger once per process (replaces handlers set by an earlier call)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if json else KeyValueFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
