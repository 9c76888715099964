"""The one coercer of untrusted JSON and YAML into typed dataclasses, every problem named by where.

Two readers use it: a run's config (core/config_parse.py: `build`, lenient as YAML is, a number
written `1e-3` read as a string taken as a float, a map's scalar values as strings, unknown keys
refused with the valid ones named) and the service's records (core/records.py: `strict`, as
islands wrote them: finite numbers only, no bool for an int, values of the declared types).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal


def build(cls: type, raw: Any, prefix: str, problems: list[str]) -> Any:
    """`cls` from the mapping `raw` (a config section), its problems appended to `problems`: unknown
    keys (with the closest valid one), wrong types (the field keeps its default, so that the range
    checks still run on the rest); None when it cannot be made at all."""
    if not isinstance(raw, Mapping):
        problems.append(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {raw!r}")
        return None
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = f"did you mean {prefix + close[0]!r}? " if close else ""
            problems.append(f"unknown key {prefix + str(key)!r}; {hint}valid keys here: {', '.join(names)}")
    kwargs = {}
    for name in names:
        if name in raw:
            before = len(problems)
            value = coerce(hints[name], raw[name], f"{prefix}{name}", problems)
            if len(problems) == before or (dataclasses.is_dataclass(hints[name]) and value is not None):
                kwargs[name] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        problems.append(f"{prefix.rstrip('.') or 'config'}: {exc}")
        return None


def coerce(tp: Any, value: Any, where: str, problems: list[str], *, strict: bool = False) -> Any:
    """`value` as annotation `tp` (a dataclass, X | None, Literal, tuple, list, dict, bool, int,
    float, str, Any), or a problem naming `where` appended and `value` returned as it is."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return build(tp, value if value is not None else {}, f"{where}.", problems)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return coerce(inner[0], value, where, problems, strict=strict)
    if origin is Literal:
        if value not in args:
            problems.append(f"{where}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            problems.append(f"{where}: expected a list of {len(args)} values, got {value!r}")
            return value
        return tuple(coerce(a, v, f"{where}[{i}]", problems, strict=strict) for i, (a, v) in enumerate(zip(args, value)))
    if origin is list:
        if not isinstance(value, list):
            problems.append(f"{where}: expected a list, got {value!r}")
            return []
        return [coerce(args[0], v, f"{where}[{i}]", problems, strict=strict) for i, v in enumerate(value)]
    if origin is dict:
        return _mapping(args, value, where, problems, strict)
    return _scalar(tp, value, where, problems, strict)


def _mapping(args: tuple, value: Any, where: str, problems: list[str], strict: bool) -> dict:
    if not isinstance(value, dict):
        problems.append(f"{where}: expected a mapping, got {value!r}")
        return {}
    if not strict:  # YAML: `extra_sbatch: {time: 30}` means the string "30"
        return {str(k): "" if v is None else str(v) for k, v in value.items()}
    for k in value:
        if not isinstance(k, str):
            problems.append(f"{where}: key {k!r} is not a string")
    return {k: coerce(args[1], v, f"{where}[{k!r}]", problems, strict=True) for k, v in value.items()}


def _scalar(tp: Any, value: Any, where: str, problems: list[str], strict: bool) -> Any:
    if tp is bool:
        if not isinstance(value, bool):
            problems.append(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and not strict:  # PyYAML reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)) or strict and not math.isfinite(value):
            problems.append(f"{where}: expected a{' finite' if strict else ''} number, got {value!r}")
            return value
        return value if strict else float(value)
    if tp is str:
        if not isinstance(value, str):
            problems.append(f"{where}: expected a string, got {value!r}")
        return value
    if strict:  # a record's field added with a type this reader does not know yet
        raise TypeError(f"no check for {tp}")
    return value
