"""Reading a checkpoint into buffers the caller keeps, and the worker's reused host copies.

A persistent worker copies its weights and optimizer state off the GPU and its next base onto it
every round; on an H100 that costs ~25x less through page-locked buffers allocated once
(worker.weights.HostBuffers). Pinned memory needs a GPU, which this machine lacks: here the same
buffers are plain CPU tensors, and what is checked is that they are reused and hold the right
bytes.
"""
from __future__ import annotations

import pytest
import torch

from core.checkpoint import load_checkpoint
from core.checkpoint_writer import write_checkpoint
from core.errors import CheckpointError
from worker.weights import HostBuffers, weights_of


def _tensors() -> dict[str, torch.Tensor]:
    return {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([1, -2], dtype=torch.int64),
            "c": torch.tensor(3.5)}


def test_a_checkpoint_is_read_into_the_buffers_given(mem):
    write_checkpoint(mem, "x.safetensors", _tensors(), manifest={})
    host = HostBuffers(torch.device("cpu"))
    first, _, _ = load_checkpoint(mem, "x.safetensors", alloc=host)
    addresses = {k: v.data_ptr() for k, v in first.items()}
    write_checkpoint(mem, "x.safetensors", {k: v * 2 for k, v in _tensors().items()}, manifest={})
    again, _, _ = load_checkpoint(mem, "x.safetensors", alloc=host)
    assert {k: v.data_ptr() for k, v in again.items()} == addresses  # the same memory, refilled
    for k, v in _tensors().items():
        assert torch.equal(again[k], v * 2)
        assert again[k] is host(k, tuple(v.shape), v.dtype)


def test_a_damaged_file_read_into_buffers_is_still_refused(mem):
    write_checkpoint(mem, "x.safetensors", _tensors(), manifest={})
    raw = bytearray(mem.read_bytes("x.safetensors"))
    raw[-1] ^= 0xFF
    mem.write_bytes("x.safetensors", bytes(raw))
    with pytest.raises(CheckpointError, match="checksum does not match"):
        load_checkpoint(mem, "x.safetensors", alloc=HostBuffers(torch.device("cpu")))


def test_a_buffer_that_does_not_fit_is_refused_and_none_means_a_new_tensor(mem):
    write_checkpoint(mem, "x.safetensors", _tensors(), manifest={})
    with pytest.raises(CheckpointError, match="buffer given for tensor a"):
        load_checkpoint(mem, "x.safetensors", alloc=lambda name, shape, dtype: torch.empty(3, 2))
    tensors, _, _ = load_checkpoint(mem, "x.safetensors", alloc=lambda name, shape, dtype: None)
    assert all(torch.equal(tensors[k], v) for k, v in _tensors().items())


def test_host_buffers_are_reused_until_the_shape_or_dtype_changes():
    host = HostBuffers(torch.device("cpu"))
    a = host("w", (2, 3), torch.float32)
    assert host("w", (2, 3), torch.float32) is a
    assert host("w", (3, 2), torch.float32) is not a
    assert host("w", (3, 2), torch.bfloat16).dtype == torch.bfloat16


def test_weights_copied_into_host_buffers_are_fp32_copies_in_the_same_memory():
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    host = HostBuffers(torch.device("cpu"))
    first = weights_of(model, host)
    assert first["weight"].dtype == torch.float32
    assert torch.equal(first["weight"], model.weight.detach().float())
    assert first["weight"].data_ptr() != model.weight.data_ptr()  # a copy, not the parameter
    with torch.no_grad():
        model.weight.add_(1)
    again = weights_of(model, host)
    assert again["weight"].data_ptr() == first["weight"].data_ptr()
    assert torch.equal(again["weight"], model.weight.detach().float())
