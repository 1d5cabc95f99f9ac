"""One way every service (node, tracker, gateway) reads its settings: pure, stdlib only.

Layers, later wins: the dataclass defaults, then a TOML file (top-level keys or
one ``[section]`` table), then environment variables ``<PREFIX><FIELD>``, then
command-line flags (a flag whose value is None was not given). Unknown keys in
any layer are an error; values are coerced to the type of the field's default
and the result goes through the config class's own ``validate()``.

The schema: every field of a config dataclass is a knob made by :func:`knobs` (or carries
:func:`knob` metadata): its help text and its topic, and the command-line spellings it had before
the schema (``aliases``, ``off_aliases``). One name per knob everywhere: the field ``max_sessions``
is the file key ``max_sessions``, the variable ``<PREFIX>MAX_SESSIONS`` and the option
``--max-sessions`` (:func:`settings` lists them; ``common.cli.config_options`` makes the options).
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

LOG_LEVELS = ("debug", "info", "warning", "error")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class ConfigError(ValueError):
    """A setting that cannot be used (an unknown key, a wrong type, a value out of range), from any
    layer of any service's config; the message names the setting and where it came from."""


class _Validated(Protocol):
    def validate(self) -> Any: ...


C = TypeVar("C", bound=_Validated)

KNOB = "knob"  # the metadata key of a field's Knob


@dataclasses.dataclass(frozen=True)
class Knob:
    """What a config field says about itself beyond its name, type and default."""

    help: str
    topic: str  # the heading it is listed under in ``--help`` and in the docs
    aliases: tuple[str, ...] = ()  # older option spellings that still set it ("--tracker")
    off_aliases: tuple[str, ...] = ()  # of a bool: older spellings that set it false ("--no-usage-reports")
    choices: tuple[str, ...] = ()  # of a str: the values it takes (the option refuses others)
    repeatable: bool = False  # of a str list (commas): the option may be given several times


def knob(help: str, *, topic: str, **more: Any) -> dict[str, Any]:
    """The metadata of a config field: ``dataclasses.field(default=..., metadata=knob(...))``."""
    return {KNOB: Knob(help, topic, **more)}


def help_of(f: dataclasses.Field[Any]) -> str:
    """A config field's help text ("" for a field without a :class:`Knob`)."""
    spec = f.metadata.get(KNOB)
    return spec.help if isinstance(spec, Knob) else ""


def knobs(topic: str) -> Callable[..., Any]:
    """A field maker for one topic: ``_kv = knobs("KV and memory")`` then
    ``max_sessions: int = _kv(8, "most sessions", aliases=(...))``."""

    def make(default: Any, help: str, **more: Any) -> Any:
        return dataclasses.field(default=default, metadata=knob(help, topic=topic, **more))

    return make


@dataclasses.dataclass(frozen=True)
class Setting:
    """One knob of a service with every name it goes by (:func:`settings`)."""

    name: str  # the field, and the key in the config file
    kind: type  # bool, int, float or str: the type of its default
    default: Any
    env: str  # the environment variable
    option: str  # the command-line option: --name-with-dashes
    knob: Knob


def option_name(name: str) -> str:
    """``max_sessions`` -> ``--max-sessions``."""
    return "--" + name.replace("_", "-")


def settings(cls: type, env_prefix: str) -> tuple[Setting, ...]:
    """Every field of the config dataclass ``cls``, in declaration order; :class:`ConfigError` for a
    field without a :class:`Knob` (help and topic) or whose default is not a bool, int, float or str."""
    out = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(KNOB)
        if not isinstance(spec, Knob) or not spec.help or not spec.topic:
            raise ConfigError(f"{cls.__name__}.{f.name} has no knob(help, topic=...)")
        if type(f.default) not in (bool, int, float, str):
            raise ConfigError(f"{cls.__name__}.{f.name}: a default of type {type(f.default).__name__}")
        out.append(
            Setting(
                f.name, type(f.default), f.default, env_prefix + f.name.upper(), option_name(f.name), spec
            )
        )
    return tuple(out)


def coerce(kind: type, name: str, value: Any, source: str) -> Any:
    """``value`` as a ``kind`` (bool, int, float or str), or :class:`ConfigError` naming the source."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif kind is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif isinstance(value, str):
        return value
    elif isinstance(value, Path):
        return str(value)
    raise ConfigError(f"{source}: {name} must be a {kind.__name__}, got {value!r}")


def load_layered(
    cls: type[C],
    *,
    section: str,
    env_prefix: str,
    file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> C:
    """Merge defaults < file < environment < flags into ``cls`` and validate it."""
    fields = {f.name: type(f.default) for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    config_file_env = env_prefix + "CONFIG"
    env = os.environ if env is None else env
    values: dict[str, Any] = {}

    def put(key: str, value: Any, source: str, unknown: str) -> None:
        if key not in fields:
            raise ConfigError(unknown)
        values[key] = coerce(fields[key], key, value, source)

    path = file or env.get(config_file_env)
    if path:
        try:
            with open(Path(path).expanduser(), "rb") as fh:
                data = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise ConfigError(f"cannot read config file {path}: {err}") from err
        table = data[section] if set(data) == {section} and isinstance(data[section], dict) else data
        for key, value in table.items():
            put(key, value, f"config file {path}", f"config file {path}: unknown key {key!r}")
    for var, value in env.items():
        if var.startswith(env_prefix) and var != config_file_env:
            key = var[len(env_prefix) :].lower()
            put(key, value, f"environment {var}", f"unknown environment variable {var}")
    for key, value in (flags or {}).items():
        if value is not None:
            put(key, value, "command line", f"unknown option {key!r}")
    result: C = cls(**values).validate()
    return result


MAX_URLS = 16


def parse_urls(urls: str | Sequence[str], what: str = "URL") -> tuple[str, ...]:
    """``"http://a:7460, http://b:7460"`` (or a list) -> validated, de-duplicated base URLs (no
    trailing slash), at most :data:`MAX_URLS`; ``ValueError`` names the bad one."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    out: list[str] = []
    for raw in items:
        url = raw.strip().rstrip("/")
        if not url:
            continue
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{what} {url!r} must start with http:// or https://")
        if url not in out:
            out.append(url)
    if not out:
        raise ValueError(f"no {what} given")
    if len(out) > MAX_URLS:
        raise ValueError(f"at most {MAX_URLS} {what}s")
    return tuple(out)
