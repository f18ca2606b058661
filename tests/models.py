"""Small deterministic models and data for fxzero's tests."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, hidden: int = 48, d_out: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc2(F.gelu(self.norm(self.fc1(x))))))


@dataclasses.dataclass(frozen=True)
class GPTArgs:
    vocab: int = 64
    dim: int = 32
    layers: int = 2
    heads: int = 2
    seq: int = 16


class Block(nn.Module):
    def __init__(self, args: GPTArgs) -> None:
        super().__init__()
        self.heads = args.heads
        self.ln1, self.ln2 = nn.LayerNorm(args.dim), nn.LayerNorm(args.dim)
        # No qkv bias: the key bias's true gradient is exactly 0 (softmax ignores it), so
        # its computed gradient is pure rounding noise that Adam scales up to lr-sized
        # steps, which would make any two implementations' params disagree.
        self.qkv = nn.Linear(args.dim, 3 * args.dim, bias=False)
        self.proj = nn.Linear(args.dim, args.dim)
        self.fc = nn.Linear(args.dim, 4 * args.dim)
        self.fc_out = nn.Linear(4 * args.dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A tiny GPT whose output head is tied to the token embedding."""

    def __init__(self, args: GPTArgs = GPTArgs()) -> None:
        super().__init__()
        self.wte = nn.Embedding(args.vocab, args.dim)
        self.wpe = nn.Embedding(args.seq, args.dim)
        self.blocks = nn.ModuleList(Block(args) for _ in range(args.layers))
        self.ln_f = nn.LayerNorm(args.dim)
        self.head = nn.Linear(args.dim, args.vocab, bias=False)
        self.head.weight = self.wte.weight
        for name, p in self.named_parameters():  # nanoGPT's init
            if name.endswith("fc_out.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * args.layers))
            elif name.startswith("w"):
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return {"mlp": MLP, "gpt": GPT}[name]()


def batch(name: str, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (identical on every rank and in the reference)."""
    g = torch.Generator().manual_seed(1000 + step)
    if name == "mlp":  # a learnable target: a fixed random teacher
        x = torch.randn(size, 16, generator=g)
        teacher = torch.randn(16, 8, generator=torch.Generator().manual_seed(7))
        return x, torch.tanh(x @ teacher)
    # counting sequences with a random start and stride: learnable next-token structure
    start = torch.randint(0, GPTArgs.vocab, (size, 1), generator=g)
    stride = torch.randint(1, 4, (size, 1), generator=g)
    tokens = (start + stride * torch.arange(GPTArgs.seq + 1)) % GPTArgs.vocab
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if name == "mlp":
        return F.mse_loss(out, target)
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def param_groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict]:
    """Two AdamW groups, as nanoGPT makes them: decay on matrices, none on the rest."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
