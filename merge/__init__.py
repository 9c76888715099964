"""Merging checkpoints: the maths (methods, outer step, LTE, late re-basing) and the streaming engine.

What the command line needs before it knows it will merge lives here, free of torch, so that
`orchestrate --help` does not load it (merge/methods.py's table is checked against it by a test).
"""

_RANDOM = {"rescale": True, "seed": 0}
METHOD_DEFAULTS: dict[str, dict[str, object]] = {
    "average": {},
    "breadcrumbs": {"scale": 1.0, "density": 0.9, "gamma": 0.01, "normalize": False},
    "breadcrumbs-ties": {"scale": 1.0, "density": 0.9, "gamma": 0.01, "normalize": False},
    "dare-linear": {"scale": 1.0, "density": 0.5, "normalize": False, **_RANDOM},
    "dare-ties": {"scale": 1.0, "density": 0.5, "normalize": False, **_RANDOM},
    "della": {"scale": 1.0, "density": 0.5, "epsilon": 0.15, "normalize": True, **_RANDOM},
    "della-linear": {"scale": 1.0, "density": 0.5, "epsilon": 0.15, "normalize": False, **_RANDOM},
    "median": {},
    "model-stock": {},
    "outer": {},
    "slerp": {"t": 0.5},
    "task-arithmetic": {"scale": 1.0},
    "ties": {"scale": 1.0, "density": 0.2, "normalize": True},
}
"""Each method's parameters and their defaults (merge.methods.METHODS uses these; `--help` shows them)."""

METHOD_NAMES = tuple(METHOD_DEFAULTS)
"""The methods `orchestrate merge --method` takes: the keys of merge.methods.METHODS."""


def defaults_of(param: str) -> str:
    """`--help`'s default of a parameter: 'ties 0.2, dare-linear 0.5, ...', grouped by value."""
    by_value: dict[object, list[str]] = {}
    for method, d in METHOD_DEFAULTS.items():
        if param in d:
            by_value.setdefault(d[param], []).append(method)
    return "; ".join(f"{', '.join(ms)}: {v}" for v, ms in by_value.items())

DEFAULT_BUFFER_BYTES = 256 << 20
"""Read buffers of all inputs together (the segment size adapts to K): the merge's working set."""
