"""Configuration files and their loader.

Precedence, lowest first: the packaged TOML file → a user file (``--config``) →
``AGENTSERVE_<SECTION>_<KEY>`` environment variables → explicit overrides (CLI flags).

One user file may hold the sections of every file in :data:`USER_FILES` (each loader takes its own), so
a section or key that none of them has is an error, as is a value of another type than the packaged one
(an int is fine where a float is expected). :data:`OPEN_SECTIONS` take any key, from a file or from
``AGENTSERVE_<SECTION>_<KEY>``; elsewhere a variable for a key no file has is left alone.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

ENV_PREFIX = "AGENTSERVE_"
USER_FILES = ("engine", "policy", "slo", "limits", "fleet")  # the packaged files a ``--config`` file overrides
OPEN_SECTIONS = frozenset({"router"})  # fleet.toml's [router]: every key goes to the router as an option
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


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


def read_user_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """:func:`read_file`, then :func:`check_known`: a typo or a wrongly typed value is a ``ConfigError``."""
    data = read_file(path)
    check_known(data, f"config file {path}")
    return data


@functools.cache
def known_settings() -> dict[str, dict[str, Any]]:
    """Every section of the :data:`USER_FILES`, each with its keys' packaged values."""
    out: dict[str, dict[str, Any]] = {}
    for name in USER_FILES:
        out = merge(out, packaged(name))
    return out


def _close(name: str, known: Any) -> str:
    near = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


def check_known(data: dict[str, Any], source: str) -> None:
    """Raise ``ConfigError`` for a section or key of ``data`` no packaged file has, or a value of the wrong type."""
    sections = known_settings()
    for section, table in data.items():
        if section not in sections:
            where = f"section [{section}]" if isinstance(table, dict) else f"key {section!r} outside any section"
            raise ConfigError(f"{source}: unknown {where}{_close(section, sections)}; "
                              f"known sections: {', '.join(sections)}")
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: {section} must be a [{section}] table, not {table!r}")
        if section in OPEN_SECTIONS:
            continue
        for key, value in table.items():
            if key not in sections[section]:
                raise ConfigError(f"{source}: unknown key [{section}] {key}{_close(key, sections[section])}")
            check_value(f"{source}: [{section}] {key}", value, sections[section][key])


def _type_name(like: Any) -> str:
    if isinstance(like, bool):
        return "a boolean (true or false)"
    if isinstance(like, int):
        return "an integer"
    if isinstance(like, float):
        return "a number"
    if isinstance(like, list):
        return "a list" + (f" of {_type_name(like[0]).removeprefix('a ').removeprefix('an ')}s" if like else "")
    return "a string" if isinstance(like, str) else f"a {type(like).__name__}"


def _is_like(value: Any, like: Any) -> bool:
    if isinstance(like, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(like, bool)
    if isinstance(like, float):
        return isinstance(value, int | float)
    if isinstance(like, list):
        return isinstance(value, list) and (not like or all(_is_like(v, like[0]) for v in value))
    return isinstance(value, type(like))


def check_value(where: str, value: Any, like: Any) -> Any:
    """``value`` for the setting ``where`` whose default is ``like``; an int becomes a float where a float is
    expected, and any other type than the default's is a ``ConfigError`` naming ``where`` and the type."""
    if not _is_like(value, like):
        raise ConfigError(f"{where}: expected {_type_name(like)}, got {type(value).__name__} {value!r}")
    return float(value) if isinstance(like, float) else value


def check_fields(cls: Any, section: str, data: Any) -> dict[str, Any]:
    """The keyword arguments for dataclass ``cls`` in table ``[section]``, each checked against the field's default:
    a key that is no field, or a value of another type, is a ``ConfigError`` naming ``[section] key``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{section} must be a [{section}] table, not {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = {}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(f"unknown key [{section}] {key}{_close(key, fields)}")
        f = fields[key]
        like = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        out[key] = check_value(f"[{section}] {key}", value, like)
    return out


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``update`` into a copy of ``base``; tables merge, everything else replaces."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def _parse(text: str, like: Any) -> Any:
    if isinstance(like, bool):
        if text.strip().lower() not in _TRUE + _FALSE:
            raise ValueError(text)
        return text.strip().lower() in _TRUE
    if isinstance(like, int):
        return int(text)
    if isinstance(like, float):
        return float(text)
    if isinstance(like, list):
        return [_parse(t, like[0]) if like else t for t in text.split(",") if t]
    return text


def _coerce(name: str, text: str, like: Any) -> Any:
    """Variable ``name``'s ``text`` as the type of ``like`` (the packaged value); ``None``: a key no file has
    (an open section's): true/false become booleans (a bare router flag), anything else stays a string."""
    if like is None:
        return {"true": True, "false": False}.get(text.strip().lower(), text)
    try:
        return _parse(text, like)
    except ValueError:
        raise ConfigError(f"environment variable {name}={text!r}: expected {_type_name(like)}") from None


def env_overrides(config: dict[str, Any], environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Apply ``AGENTSERVE_<SECTION>_<KEY>`` (or ``AGENTSERVE_<KEY>`` for top-level keys) variables.

    Only keys ``config`` has are read, except in :data:`OPEN_SECTIONS`, which take every ``<KEY>``."""
    environ = dict(os.environ if environ is None else environ)
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            prefix = f"{ENV_PREFIX}{key}_".upper()
            names = {f"{prefix}{k}".upper(): k for k, v in value.items() if not isinstance(v, dict)}
            if key in OPEN_SECTIONS:
                names |= {n: n.removeprefix(prefix).lower() for n in environ if n.startswith(prefix) and n not in names}
            sub = {k: _coerce(n, environ[n], value.get(k)) for n, k in names.items() if n in environ}
            if sub:
                out[key] = sub
        elif f"{ENV_PREFIX}{key}".upper() in environ:
            name = f"{ENV_PREFIX}{key}".upper()
            out[key] = _coerce(name, environ[name], value)
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
        config = merge(config, read_user_file(user_file))
    config = env_overrides(config, environ)
    if overrides:
        config = merge(config, {k: v for k, v in overrides.items() if v is not None})
    return config
