"""The one coercer (core/coerce.py): the service's records are read strictly, a config leniently.

Property: strict coercion accepts a JSON value for a record field's annotation exactly when a plain
reading of the annotation does (the oracle below, written out case by case), and returns the value
unchanged; lenient coercion is what YAML needs (1e-3 read as a string is a float, a map's scalars
are strings)."""
from __future__ import annotations

import math
import typing
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from core.coerce import coerce

ANNOTATIONS = [int, float, str, bool, int | None, float | None, list[int], list[str], dict[str, float],
               dict[str, str], dict[str, int], list[dict[str, Any]], dict[str, Any], Any]


def oracle(v: Any, tp: Any) -> bool:
    if tp is Any:
        return True
    if tp is bool:
        return type(v) is bool
    if tp is int:
        return type(v) is int
    if tp is float:
        return type(v) in (int, float) and math.isfinite(v)
    if tp is str:
        return type(v) is str
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if type(None) in args:
        return v is None or oracle(v, args[0])
    if origin is list:
        return type(v) is list and all(oracle(x, args[0]) for x in v)
    if origin is dict:
        return type(v) is dict and all(type(k) is str and oracle(x, args[1]) for k, x in v.items())
    raise AssertionError(tp)


scalars = st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats() | st.text(max_size=5)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                           max_leaves=8)


@given(json_values, st.sampled_from(ANNOTATIONS))
def test_strict_coercion_accepts_what_the_annotation_says_and_changes_nothing(v, tp):
    problems: list[str] = []
    out = coerce(tp, v, "field", problems, strict=True)
    assert (problems == []) == oracle(v, tp), (v, tp, problems)
    if not problems:
        assert out == v or (isinstance(v, float) and math.isnan(v))


def test_lenient_coercion_reads_yaml_as_a_config_means_it():
    problems: list[str] = []
    assert coerce(float, "1e-3", "inner.lr", problems) == 1e-3
    assert coerce(float, 2, "inner.lr", problems) == 2.0 and type(coerce(float, 2, "x", problems)) is float
    assert coerce(dict[str, str], {"time": 30, "qos": None}, "extra_sbatch", problems) == {"time": "30", "qos": ""}
    assert problems == []
    coerce(float, "fast", "inner.lr", problems)
    coerce(int, True, "rounds", problems)
    assert problems == ["inner.lr: expected a number, got 'fast'", "rounds: expected an integer, got True"]


def test_strict_coercion_refuses_what_a_config_would_take():
    for tp, v in [(float, "1e-3"), (float, math.inf), (float, math.nan), (dict[str, str], {"time": 30}), (int, 1.0)]:
        problems: list[str] = []
        coerce(tp, v, "f", problems, strict=True)
        assert problems, (tp, v)
