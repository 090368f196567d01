"""Turns parsed YAML into frozen config dataclasses, with errors that name the YAML path.

The loader is driven by the dataclasses' type hints: it checks types, rejects unknown keys,
fills defaults, interpolates ${VAR} / ${VAR:-default} from the environment, and prefixes every
ValueError a dataclass's __post_init__ raises with the path the user wrote.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, TypeVar, Union

import yaml

T = TypeVar("T")

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class ConfigError(ValueError):
    """A config problem at a YAML path, e.g. `pools.default.workers[1].url: not an http(s) URL`."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)


def load_yaml_file(path: str | Path, cls: type[T], env: Mapping[str, str] | None = None) -> T:
    """Read a YAML file into `cls`. Messages leave out the file name: the caller prints `<file>: <message>`."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError("", f"cannot read the file: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("", yaml_error_message(exc)) from None
    return build(cls, {} if data is None else data, env=env)


def yaml_error_message(exc: yaml.YAMLError) -> str:
    """A YAML syntax error on one line: `not valid YAML at line 3, column 7: <problem>`."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"not valid YAML{where}: {problem}"


def build(cls: type[T], data: Any, path: str = "", env: Mapping[str, str] | None = None) -> T:
    """Build `cls` (a dataclass) from plain data, validating as described in the module docstring."""
    return _convert(cls, data, path, os.environ if env is None else env)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a mapping"}.get(type(value), type(value).__name__)


def _interpolate(value: str, path: str, env: Mapping[str, str]) -> str:
    def substitute(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in env:
            return env[name]
        if default is not None:
            return default
        raise ConfigError(path, f"environment variable {name} is not set")

    return _VAR.sub(substitute, value)


def _convert(tp: Any, value: Any, path: str, env: Mapping[str, str]) -> Any:
    if isinstance(value, str):
        value = _interpolate(value, path, env)
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return _convert_optional(tp, value, path, env)
    if dataclasses.is_dataclass(tp):
        return _convert_dataclass(tp, value, path, env)
    if origin is Literal:
        if value not in typing.get_args(tp):
            allowed = ", ".join(str(a) for a in typing.get_args(tp))
            raise ConfigError(path, f"must be one of: {allowed} (got {value!r})")
        return value
    if origin is tuple:
        return _convert_list(typing.get_args(tp)[0], value, path, env)
    if origin is dict:
        return _convert_mapping(typing.get_args(tp)[1], value, path, env)
    return _convert_scalar(tp, value, path)


def _convert_optional(tp: Any, value: Any, path: str, env: Mapping[str, str]) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if value is None:
        return None
    if len(args) == 1:
        return _convert(args[0], value, path, env)
    lists = [a for a in args if typing.get_origin(a) is tuple]
    scalars = [a for a in args if a in _SCALAR_NAMES]
    if len(lists) > 1 or len(lists) + len(scalars) != len(args):
        raise TypeError(f"unsupported config type {tp}")
    if lists and isinstance(value, list):  # e.g. bool | tuple[str, ...]: true, or a list
        return _convert(lists[0], value, path, env)
    if lists and not any(_fits(a, value) for a in scalars):
        expected = " or ".join([*(_SCALAR_NAMES[a] for a in scalars), "a list"])
        raise ConfigError(path, f"expected {expected}, got {_type_name(value)}")
    return _convert_scalar_union(scalars, value, path)


def _fits(tp: Any, value: Any) -> bool:
    try:
        _convert_scalar(tp, value, "")
    except ConfigError:
        return False
    return True


_SCALAR_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


def _convert_scalar_union(args: list[Any], value: Any, path: str) -> Any:
    """A union of scalar types (e.g. bool | str): the first of them, in order, that value converts to."""
    for tp in args:
        try:
            return _convert_scalar(tp, value, path)
        except ConfigError:
            continue
    expected = " or ".join(_SCALAR_NAMES[a] for a in args)
    raise ConfigError(path, f"expected {expected}, got {_type_name(value)}")


def _convert_scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(path, f"expected a boolean, got {_type_name(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and re.fullmatch(r"[+-]?\d+", value.strip()):
            return int(value)
        raise ConfigError(path, f"expected an integer, got {_type_name(value)} {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(path, f"expected a number, got {_type_name(value)} {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(path, f"expected a string, got {_type_name(value)}")
    raise TypeError(f"unsupported config type {tp}")


def _convert_list(item_tp: Any, value: Any, path: str, env: Mapping[str, str]) -> tuple:
    if not isinstance(value, list):
        raise ConfigError(path, f"expected a list, got {_type_name(value)}")
    return tuple(_convert(item_tp, item, f"{path}[{i}]", env) for i, item in enumerate(value))


def _convert_mapping(item_tp: Any, value: Any, path: str, env: Mapping[str, str]) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(path, f"expected a mapping, got {_type_name(value)}")
    result = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise ConfigError(path, f"keys must be strings, got {key!r}")
        result[key] = _convert(item_tp, item, _join(path, key), env)
    return result


def _convert_dataclass(cls: Any, value: Any, path: str, env: Mapping[str, str]) -> Any:
    if not isinstance(value, dict):
        raise ConfigError(path, f"expected a mapping, got {_type_name(value)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in value if k not in fields]
    if unknown:
        expected = ", ".join(fields)
        raise ConfigError(_join(path, str(unknown[0])), f"unknown key (expected one of: {expected})")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, field in fields.items():
        if name in value:
            kwargs[name] = _convert(hints[name], value[name], _join(path, name), env)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(_join(path, name), "required")
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(_join(path, exc.path) if exc.path else path, exc.message) from None
    except ValueError as exc:
        raise ConfigError(path, str(exc)) from None
