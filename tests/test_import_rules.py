"""The structure rules of docs/architecture.md, checked by parsing the source (not importing it, so
an import that only some path reaches counts too):

- every import, deferred ones inside functions too (`if TYPE_CHECKING:` ones are not imports at
  run time): core imports no role; worker and merge import neither each other nor orchestrator;
  no modules import each other in a loop;
- no function over 60 lines; none in merge/ takes more than 6 parameters (one typed object
  instead: merge.round_spec.RoundSpec, merge.engine.MergeJob, merge.manual.ManualMerge);
- two modules touch submitit; only the storage layer touches fsspec's filesystem; only core/layout.py
  spells a path of the run directory."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("core", "worker", "merge", "orchestrator")
FORBIDDEN = {"core": {"worker", "merge", "orchestrator"}, "worker": {"merge", "orchestrator"},
             "merge": {"worker", "orchestrator"}}


def _module(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(root: Path, path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports, wherever the import statement is."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for n in ast.walk(node)}
    here = _module(root, path).split(".")
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package the module is in
                package = here if path.name == "__init__.py" else here[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return {m for m in out if m in modules}


def import_graph(root: Path) -> dict[str, set[str]]:
    paths = {_module(root, p): p for pkg in PACKAGES if (root / pkg).is_dir() for p in (root / pkg).rglob("*.py")}
    return {m: _imports(root, p, set(paths)) - {m} for m, p in paths.items()}


def broken_rules(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} imports {d}" for m, deps in graph.items() for d in deps
                  if d.split(".")[0] in FORBIDDEN.get(m.split(".")[0], set()))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import loops: strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                out.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_source_keeps_the_import_rules_and_has_no_import_loop():
    graph = import_graph(ROOT)
    assert len(graph) > 80 and graph["merge.rounds"] >= {"core.checkpoint", "merge.outer"}  # it did parse the tree
    assert broken_rules(graph) == []
    assert cycles(graph) == []


def test_the_checker_finds_a_deferred_loop_and_a_broken_rule(tmp_path):
    """A loop closed by an import inside a function, and a merge module that imports the
    orchestrator (deferred too), are both found; an import under TYPE_CHECKING is not one."""
    files = {
        "core/__init__.py": "",
        "core/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from merge import b\n",
        "merge/__init__.py": "",
        "merge/b.py": "from merge.c import thing\n",
        "merge/c.py": "def f():\n    from merge import b\n    from orchestrator.d import run\n",
        "orchestrator/__init__.py": "",
        "orchestrator/d.py": "from . import e\n",
        "orchestrator/e.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path)
    assert graph["orchestrator.d"] == {"orchestrator.e"} and graph["core.a"] == set()
    assert broken_rules(graph) == ["merge.c imports orchestrator.d"]
    assert cycles(graph) == [["merge.b", "merge.c"]]


def _functions(root: Path):
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield pkg, f"{path.relative_to(root)}:{node.lineno} {node.name}", node


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = node.args
    named = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
    return len(named) + (a.vararg is not None) + (a.kwarg is not None)


def test_no_long_function_and_no_argument_bundle_in_merge():
    functions = list(_functions(ROOT))
    assert len(functions) > 500
    assert [f"{where}: {n.end_lineno - n.lineno + 1} lines" for _, where, n in functions
            if n.end_lineno - n.lineno + 1 > 60] == []
    assert [f"{where}: {_parameters(n)} parameters" for pkg, where, n in functions
            if pkg == "merge" and _parameters(n) > 6] == []


def test_submitit_is_touched_by_the_two_modules_docs_architecture_names():
    """orchestrator/executor.py submits and watches jobs; worker/ranks.py reads a running job's
    environment. Nobody else imports submitit (docs/architecture.md)."""
    touching = set()
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
                if any(n == "submitit" or n.startswith("submitit.") for n in names):
                    touching.add(_module(ROOT, path))
    assert touching == {"orchestrator.executor", "worker.ranks"}, touching


def test_only_the_storage_layer_touches_the_filesystem_object():
    """Every read and write of storage goes through core.storage.Storage (its retries, fencing and,
    locally, its refusal of links and FIFOs): nobody else reaches `storage.fs` (fsspec's filesystem),
    and only the two backends and Storage itself hold one."""
    layer = {"core.storage", "core.files", "core.local_files"}
    reaching = set()
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if _module(ROOT, path) in layer:
                continue
            tree = ast.parse(path.read_text())
            if any(isinstance(n, ast.Attribute) and n.attr == "fs" for n in ast.walk(tree)):
                reaching.add(_module(ROOT, path))
    assert reaching == set(), reaching


def test_only_core_layout_spells_a_path_of_the_run_directory():
    """docs/architecture.md: core/layout.py is the only place that formats a path of a run. No string
    in the library outside it (docstrings aside) begins with one of the run directory's folders."""
    folders = ("rounds/", "global/", "workers/", "outer/", "final/", "metrics/", "lease/")
    spelled = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if _module(ROOT, path) == "core.layout":
                continue
            tree = ast.parse(path.read_text())
            docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                          if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                          and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
            spelled += [f"{_module(ROOT, path)}:{n.lineno}" for n in ast.walk(tree)
                        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
                        and n.value.startswith(folders)]
    assert spelled == [], spelled
