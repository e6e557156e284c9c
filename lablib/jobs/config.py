"""Typed, strict options for run scripts.

Every run script declares a frozen dataclass of options. The launcher validates a notebook's keyword
arguments against it *before* starting torchrun (a typo fails in a millisecond, not after a rendezvous),
and the script parses the same options from its command line. Unknown names and wrong types are errors
that list what is accepted.
"""

from __future__ import annotations

import dataclasses
import typing

_SCALARS = (int, float, str, bool)


class ConfigError(ValueError):
    """An option that does not exist or has the wrong type."""


def require_at_least_one(config, *names: str) -> None:
    """A Config's ``validate`` calls this for its counts (steps, sizes, ...): each named option must be >= 1."""
    for name in names:
        value = getattr(config, name)
        if value < 1:
            raise ValueError(f"{name}={value} must be at least 1")


def _fields(cls) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _describe(cls) -> str:
    parts = []
    for f in dataclasses.fields(cls):
        t = _fields(cls)[f.name]
        parts.append(f"{f.name}: {getattr(t, '__name__', str(t))} = {f.default!r}")
    return ", ".join(parts)


def _coerce(name: str, typ: type, value, cls):
    """Convert value (from Python or from a command-line string) to typ, or raise ConfigError."""
    origin = typing.get_origin(typ)
    if origin in (tuple, list):  # tuple[int, ...] written on the command line as "1,2,4"
        (item_t, *_) = typing.get_args(typ)
        items = value.split(",") if isinstance(value, str) else list(value)
        return tuple(_coerce(name, item_t, v, cls) for v in items if v != "")
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif typ is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"option {name}={value!r} should be of type {getattr(typ, '__name__', typ)} "
                      f"for {cls.__name__}; accepted options: {_describe(cls)}")


def from_options(cls, options: dict):
    """Build the config dataclass from keyword options; unknown names and wrong types are errors."""
    fields = _fields(cls)
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ConfigError(f"unknown option(s) {', '.join(unknown)} for {cls.__name__}; "
                          f"accepted options: {_describe(cls)}")
    values = {k: _coerce(k, fields[k], v, cls) for k, v in options.items()}
    config = cls(**values)
    validate = getattr(config, "validate", None)
    if validate is not None:
        validate()
    return config


def to_argv(config) -> list[str]:
    """The command-line form of a config: ['--name', 'value', ...]."""
    argv = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, tuple):
            value = ",".join(str(v) for v in value)
        argv += [f"--{f.name}", str(value)]
    return argv


def from_argv(cls, argv: list[str]):
    """Parse ['--name', 'value', ...] strictly into the config dataclass."""
    options = {}
    it = iter(argv)
    for token in it:
        if not token.startswith("--"):
            raise ConfigError(f"expected --name value pairs, got {token!r}; accepted options: {_describe(cls)}")
        name = token[2:].replace("-", "_")
        if "=" in name:
            name, value = name.split("=", 1)
        else:
            value = next(it, None)
            if value is None:
                raise ConfigError(f"option --{name} has no value")
        options[name] = value
    return from_options(cls, options)
