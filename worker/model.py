"""A small decoder-only transformer over bytes (vocab 256), in the spirit of nanoGPT's model.py.

Parameter names are part of the on-disk format: every state_dict key is a tensor name in a
safetensors checkpoint and merges match tensors by name across workers. Renaming a module here
breaks every checkpoint written before, so don't, or bump the checkpoint format.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_head: int, n_embd: int, dropout: float, bias: bool):
        super().__init__()
        # one matmul produces q, k and v for all heads at once
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head = n_head
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim): attention runs per head
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # the fused kernel (flash / memory-efficient where available) applies the causal mask itself
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN block: normalising before each sublayer keeps the residual stream an identity path,
    which is what lets deep stacks train without warmup tricks."""

    def __init__(self, n_head: int, n_embd: int, dropout: float, bias: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_head, n_embd, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(
        self,
        n_layer: int,
        n_head: int,
        n_embd: int,
        block_size: int,
        vocab_size: int = 256,
        dropout: float = 0.0,
        bias: bool = True,
    ):
        super().__init__()
        sizes = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size,
                     vocab_size=vocab_size)
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"GPT needs {name} >= 1, got {value}; set a positive {name}.")
        if n_embd % n_head != 0:
            nearest = n_head * max(1, n_embd // n_head)
            raise ValueError(
                f"GPT needs n_embd divisible by n_head so every head gets the same width, but "
                f"n_embd={n_embd} is not a multiple of n_head={n_head}; pick e.g. n_embd={nearest}."
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"GPT needs 0 <= dropout < 1, got dropout={dropout}.")
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd
        self.block_size, self.vocab_size = block_size, vocab_size
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab_size, n_embd),
                wpe=nn.Embedding(block_size, n_embd),
                drop=nn.Dropout(dropout),
                h=nn.ModuleList([Block(n_head, n_embd, dropout, bias) for _ in range(n_layer)]),
                ln_f=nn.LayerNorm(n_embd, bias=bias),
            )
        )
        # Not tied to wte: safetensors refuses shared storage, and a tied pair would also be
        # averaged twice by a merge that walks tensor names.
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02) everywhere, and the projections that write into the residual
        stream scaled by 1/sqrt(2*n_layer) so its variance does not grow with depth."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.n_layer))

    def num_params(self) -> int:
        """All parameters, position embedding and lm_head included (what a checkpoint stores)."""
        return sum(p.numel() for p in self.parameters())

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW groups as in nanoGPT: decay every >=2-D tensor (matmul weights, embeddings),
        not biases and LayerNorm gains. Parameters are ordered by name so the optimizer state
        indices mean the same tensor in every process."""
        named = sorted(self.named_parameters(), key=lambda kv: kv[0])
        decay = [p for _, p in named if p.dim() >= 2]
        no_decay = [p for _, p in named if p.dim() < 2]
        return [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, vocab) and, given targets, the mean cross-entropy (-1 targets ignored)."""
        B, T = idx.shape
        if T > self.block_size:
            raise ValueError(
                f"GPT.forward got a sequence of length {T} but the model's block_size is "
                f"{self.block_size}; crop the input to the last {self.block_size} tokens."
            )
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(
            logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1
        )
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
    ) -> torch.Tensor:
        """Append max_new_tokens sampled tokens to idx (B, T); call eval() first if dropout > 0."""
        if temperature <= 0:
            raise ValueError(f"generate needs temperature > 0, got {temperature}; use a small "
                             "value such as 1e-3 for near-greedy decoding.")
        for _ in range(max_new_tokens):
            # the model only knows block_size positions: condition on the most recent ones
            idx_cond = idx if idx.size(1) <= self.block_size else idx[:, -self.block_size :]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
        return idx
