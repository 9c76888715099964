"""Task `lm`: a causal language model (the built-in GPT, or the Hugging Face model at model.hf) on a
prepared token dataset (data.source, or text prepared into the cache), scored by next-token loss.

A batch is (x, y): windows of block_size tokens and the same shifted by one (-1: no loss there);
both models take (x, y) and return (logits, loss). Its metadata is the model's description, so a
checkpoint alone rebuilds the model (worker/weights.py load_model).
"""
from __future__ import annotations

from typing import Any

import torch

from core.config import Config
from core.records import text
from worker.data import BatchSampler, Dataset, dataset_for, deal_groups, eval_batches, group_tokens
from worker.tasks import Runner
from worker.weights import build_model, model_metadata


class LanguageModel(Runner):
    name = "lm"

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self._dataset: Dataset | None = None

    @property
    def dataset(self) -> Dataset:
        if self._dataset is None:
            self._dataset = dataset_for(self.cfg)  # opened once: the index checked, files listed
        return self._dataset

    def build_model(self, pretrained: bool = True) -> torch.nn.Module:
        return build_model(self.cfg.model, pretrained=pretrained)

    def sampler(self, worker: int, num_workers: int, batch_size: int) -> BatchSampler:
        c = self.cfg
        return BatchSampler(self.dataset, c.model.block_size, batch_size, c.seed, worker, num_workers, c.data.sharding)

    def eval_batches(self, n: int, batch_size: int) -> list[Any]:
        return eval_batches(self.dataset, self.cfg.model.block_size, batch_size, n, self.cfg.seed)

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return model(x, y)[1]

    def check(self) -> None:
        """The dataset prepared (text: into the cache once), its tokenizer the model's, and dealt to the
        workers (non-iid: whole groups), so a corpus the run cannot deal fails here, not in K jobs. The
        first and last worker stand for all: a deal fails for every worker or none (a worker's share is
        never empty once the deal succeeds), and K samplers of a big index would cost seconds."""
        for worker in {0, self.cfg.workers - 1}:
            self.sampler(worker, self.cfg.workers, self.cfg.worker_batch_size)

    def describe_data(self, most: int = 4) -> str:
        """Which data each worker reads: the dataset, its train split, and the deal (iid: a share of
        its segments each; non-iid: whole groups, named for the first `most` workers)."""
        c, ds = self.cfg, self.dataset
        train = [s for s in ds.index.split("train") if s.tokens > c.model.block_size]
        tokens = sum(s.tokens for s in train)
        source = c.data.source or "the Python standard library's source (the default corpus)"
        line = f"data: {source}, {tokens:,} train tokens in {len(train)} shard(s)"
        if c.data.sharding == "iid":
            return line + (f"; iid: each of the {c.workers} workers draws windows from its own 1/{c.workers} of "
                           f"them (dealt at random by seed {c.seed})")
        sizes = group_tokens(train)
        deal = deal_groups(train, c.workers, ds.url)
        parts = [f"worker {w}: {', '.join(text(g, 40) or '?' for g in groups[:3])}"
                 + (f" and {len(groups) - 3} more" if len(groups) > 3 else "")
                 + f" ({sum(sizes[g] for g in groups) / max(1, tokens):.0%})" for w, groups in enumerate(deal[:most])]
        more = f"; and {c.workers - most} more workers" if c.workers > most else ""
        return line + f"; non-iid, {len(sizes)} groups dealt whole: " + "; ".join(parts) + more

    def metadata(self) -> dict[str, str]:
        return model_metadata(self.cfg.model)
