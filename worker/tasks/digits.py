"""Task `digits`: image classification with a small Vision Transformer, written exactly as a user's
task is (docs/tasks.md), so that it is the interface's proof as much as an example.

The images are scikit-learn's bundled handwritten digits (1,797 grey 8x8 images of 0-9, from the
UCI ML repository: no download), upsampled to 16x16 and normalised; every fifth is held out for the
eval. The model is Hugging Face's ViTForImageClassification (patches of 4x4, 4 blocks of width 64):
its attention and MLP are plain nn.Linear layers, so `--algorithm lte` puts LoRA heads on them
without this file knowing about LoRA. The papers' lo-fi and LTE experiments fine-tune and train ViTs
on ImageNet-scale data; this is the same kind of model at a size a laptop CPU trains in seconds.
(timm's and torchvision's ViTs were the first choice; torchvision, which timm imports, does not load
beside the CPU build of torch this project pins.) Needs `pip install 'islands[vision]'`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn import functional as F

from core.config import Config
from core.errors import IslandsError

IMAGE = 16
HELD_OUT_EVERY = 5


class Digits:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self._splits: dict[str, list[tuple[torch.Tensor, int]]] | None = None

    def model(self) -> torch.nn.Module:
        with _vision():
            from transformers import ViTConfig, ViTForImageClassification
        return ViTForImageClassification(ViTConfig(image_size=IMAGE, patch_size=4, num_channels=1, hidden_size=64,
                                                   num_hidden_layers=4, num_attention_heads=4, intermediate_size=128,
                                                   num_labels=10))

    def examples(self, split: str) -> list[tuple[torch.Tensor, int]]:
        if self._splits is None:
            with _vision():
                from sklearn.datasets import load_digits
            data = load_digits()
            images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
            images = F.interpolate(images, size=(IMAGE, IMAGE), mode="bilinear", align_corners=False)
            images = (images - 0.5) / 0.5
            pairs = list(zip(images, data.target.tolist()))
            self._splits = {"eval": pairs[::HELD_OUT_EVERY],
                            "train": [p for i, p in enumerate(pairs) if i % HELD_OUT_EVERY]}
        return self._splits[split]

    def collate(self, examples: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack([x for x, _ in examples]), torch.tensor([y for _, y in examples])

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images).logits, labels)

    def metrics(self, model: torch.nn.Module, batch: Any) -> dict[str, float]:
        images, labels = batch
        return {"accuracy": (model(images).logits.argmax(-1) == labels).float().mean().item()}


@contextlib.contextmanager
def _vision() -> Iterator[None]:
    """The imports of the `vision` extra: one missing is one error saying what to install."""
    try:
        yield
    except ImportError as exc:
        raise IslandsError(f"task digits needs {exc.name or 'a module'} ({exc}): install the vision extra, "
                           "pip install 'islands[vision]' (scikit-learn and transformers)") from None
