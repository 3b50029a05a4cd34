"""Engine flags shared by ``agentserve up`` and ``agentserve generate``, and how they override engine.toml."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from agentserve import configs


def engine_flags(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--dtype``, ``--weights`` and ``--device`` (unset: engine.toml's value)."""
    for flag in reversed((
        click.option("--dtype", default=None, help="auto | bfloat16 | float16 | float32"),
        click.option("--weights", default=None, help="auto | dense | fp16 | hybrid (CPU matrix formats; engine.toml)"),
        click.option("--device", default=None, help="auto | cpu | cuda"),
    )):
        command = flag(command)
    return command


def engine_config(config_file: str | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """The ``[engine]`` section: packaged file, ``config_file``, environment, then the flags given (not None)."""
    given = {k: v for k, v in overrides.items() if v is not None}
    return configs.load("engine", config_file, {"engine": given})["engine"]
