"""docs/config.md, generated from the config dataclasses' field docstrings (the one source).

    python -m core.config_docs > docs/config.md      (a test fails when the page is out of date)
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import typing

from core import config as C

SECTIONS = [("", C.Config), ("model.", C.ModelConfig), ("data.", C.DataConfig), ("inner.", C.InnerConfig),
            ("outer.", C.OuterConfig), ("lte.", C.LteConfig), ("round.", C.RoundConfig), ("executor.", C.ExecutorConfig), ("log.", C.LogConfig)]


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings: the string literal right under each annotated field."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[stmt.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _type_name(tp: object) -> str:
    text = str(tp).replace("typing.", "")
    return text.replace("<class '", "").replace("'>", "")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return "null" if f.default is None else repr(f.default).replace("'", "")
    value = f.default_factory()  # type: ignore[misc]
    return "" if dataclasses.is_dataclass(value) else repr(value)


def render() -> str:
    out = ["# Configuration", "",
           "One YAML file (`orchestrate submit --config FILE`), common keys as flags (`--workers`, `--rounds`,",
           "`--inner-steps`, `--algorithm`, `--executor`, `--run-dir`), and any key with `--set dotted.key=value`",
           "(values are parsed as YAML: `--set outer.betas=[0.9,0.99]`). Unknown keys are rejected with the valid",
           "ones named; every problem is reported at once. The resolved config is written to",
           "`<run_dir>/config.yaml`, which is what `orchestrate resume` uses.", "",
           "Presets: `--algorithm fedavg` sets `outer.optimizer: sgd, outer.lr: 1.0`; `--algorithm lofi` sets",
           "`rounds: 1` and the same plain average. Keys you set yourself win over a preset.", "",
           "Generated from `core/config.py` by `python -m core.config_docs`.", ""]
    for prefix, cls in SECTIONS:
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        out += [f"## `{prefix.rstrip('.') or 'top level'}`", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                continue
            out.append(f"| `{prefix}{f.name}` | `{_type_name(hints[f.name])}` | `{_default(f)}` | {docs.get(f.name, '')} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")
