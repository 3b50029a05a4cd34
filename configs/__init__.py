"""Configuration files and their loader.

Precedence, lowest first: the packaged TOML file → a user file (``--config``) →
``AGENTSERVE_<SECTION>_<KEY>`` environment variables → explicit overrides (CLI flags).
"""

from __future__ import annotations

import os
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

ENV_PREFIX = "AGENTSERVE_"


class ConfigError(ValueError):
    """A configuration file or value is missing or malformed."""


def cache_dir(env: str, name: str) -> Path:
    """Where AgentServe keeps what it writes once and reuses: ``$env`` if set, else ``~/.cache/agentserve/<name>``."""
    value = os.environ.get(env)
    return Path(value) if value else Path.home() / ".cache" / "agentserve" / name


def packaged(name: str) -> dict[str, Any]:
    """Read a TOML file shipped in ``agentserve.configs`` (``name`` without ``.toml``; may hold a ``/``)."""
    parts = name.split("/")
    node = resources.files("agentserve.configs").joinpath(*parts[:-1], parts[-1] + ".toml")
    if not node.is_file():
        raise ConfigError(f"no packaged config named {name!r}")
    return tomllib.loads(node.read_text(encoding="utf-8"))


def read_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a user TOML file, with a clear error when it is missing or malformed."""
    p = Path(path)
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {p}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {p} is not valid TOML: {e}") from None


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``update`` into a copy of ``base``; tables merge, everything else replaces."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def _coerce(text: str, like: Any) -> Any:
    if isinstance(like, bool):
        return text.strip().lower() in ("1", "true", "yes", "on")
    if isinstance(like, int):
        return int(text)
    if isinstance(like, float):
        return float(text)
    if isinstance(like, list):
        return [_coerce(t, like[0]) if like else t for t in text.split(",") if t]
    return text


def env_overrides(config: dict[str, Any], environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Apply ``AGENTSERVE_<SECTION>_<KEY>`` (or ``AGENTSERVE_<KEY>`` for top-level keys) variables."""
    environ = dict(os.environ if environ is None else environ)
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            sub = {
                k: _coerce(environ[f"{ENV_PREFIX}{key}_{k}".upper()], v)
                for k, v in value.items()
                if not isinstance(v, dict) and f"{ENV_PREFIX}{key}_{k}".upper() in environ
            }
            if sub:
                out[key] = sub
        elif f"{ENV_PREFIX}{key}".upper() in environ:
            out[key] = _coerce(environ[f"{ENV_PREFIX}{key}".upper()], value)
    return merge(config, out)


def load(
    name: str,
    user_file: str | os.PathLike[str] | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Load packaged config ``name`` with a user file, environment and explicit overrides applied."""
    config = packaged(name)
    if user_file is not None:
        config = merge(config, read_file(user_file))
    config = env_overrides(config, environ)
    if overrides:
        config = merge(config, {k: v for k, v in overrides.items() if v is not None})
    return config
