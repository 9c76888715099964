"""Reproduce the DiLoCo, lo-fi and LTE papers' key comparisons at small scale: `python -m bench.reproduce`.

K workers are simulated one after another in one process, with the toolkit's real pieces: the
worker's model, data shards, batch sampler, AdamW, lr schedule and training loop (worker/), and the
merge service's outer step and LTE merge maths (merge/). See docs/results.md for the results.
"""
