"""Merging checkpoints: the maths (methods, outer step, LTE, late re-basing) and the streaming engine.

What the command line needs before it knows it will merge lives here, free of torch, so that
`orchestrate --help` does not load it (merge/methods.py's table is checked against it by a test).
"""

METHOD_NAMES = ("average", "median", "outer", "slerp", "task-arithmetic", "ties")
"""The methods `orchestrate merge --method` takes: the keys of merge.methods.METHODS."""

DEFAULT_BUFFER_BYTES = 256 << 20
"""Read buffers of all inputs together (the segment size adapts to K): the merge's working set."""
