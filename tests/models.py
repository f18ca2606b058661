"""Small deterministic models and data for fxzero's tests."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, TypeVar

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
    graph_break: bool = False
    """Break the Dynamo graph after the embeddings: buckets span two graphs."""
    loop_break: bool = False
    """Break inside the block loop: Dynamo runs GPT.forward eagerly and compiles
    Block.forward once, reusing that graph for every block with other params."""
    eager_head: bool = False
    """Run the tied output head eagerly (``torch.compiler.disable``): a param read both
    by a compiled graph (the embedding) and by an eager region (the head)."""


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


@torch.compiler.disable
def _eager_head(head: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return head(x)


class GPT(nn.Module):
    """A tiny GPT whose output head is tied to the token embedding."""

    def __init__(self, args: GPTArgs = GPTArgs()) -> None:
        super().__init__()
        self.args = args
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
        if self.args.graph_break:
            torch._dynamo.graph_break()
        for block in self.blocks:
            x = block(x)
            if self.args.loop_break:
                torch._dynamo.graph_break()
        x = self.ln_f(x)
        return _eager_head(self.head, x) if self.args.eager_head else self.head(x)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)  # batch-independent, unlike BatchNorm, so DP == big batch
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv2(F.relu(self.norm(self.conv1(x)))))
        return self.fc(x.mean(dim=(2, 3)))


class BranchMLP(MLP):
    """An MLP with an extra layer used only on some steps (``use_extra``)."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(48, 48)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = F.gelu(self.fc2(F.gelu(self.norm(self.fc1(x)))))
        if use_extra:
            h = h + self.extra(h)
        return self.out(h)


class AdapterNet(nn.Module):
    """A shared trunk around same-shaped adapters picked by a Python int (multi-task
    adapters; MoE experts routed in Python). The graphs compiled for different picks
    share their first and last params and their length, and differ in between."""

    def __init__(self, adapters: int = 4, dim: int = 24) -> None:
        super().__init__()
        self.inp = nn.Linear(16, dim)
        self.adapters = nn.ModuleList(nn.Linear(dim, dim) for _ in range(adapters))
        self.out = nn.Linear(dim, 8)

    def forward(self, x: torch.Tensor, pick: int = 0) -> torch.Tensor:
        return self.out(F.gelu(self.adapters[pick](F.gelu(self.inp(x)))))


class _Experts(nn.Module):
    """Experts as one 3-D param, run in a loop over the experts some token picked (Hugging
    Face's MoE layers): ``unique`` makes Dynamo break the graph inside this module, after
    its entry, and the rest of its forward, which reads its param, runs outside the graph
    that entered it (no forward pre-hook of its own runs for that rest)."""

    def __init__(self, experts: int, dim: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(experts, dim, dim) / math.sqrt(dim))

    def forward(self, x: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in top.unique():
            rows = (top == expert).nonzero().squeeze(1)
            out = out.index_add(0, rows, x[rows] @ self.w[expert])
        return out


class ExpertLoop(nn.Module):
    """A router picking one of four experts per token, the experts run in a Python loop."""

    def __init__(self, experts: int = 4, dim: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(16, dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = _Experts(experts, dim)
        self.out = nn.Linear(dim, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.inp(x))
        return self.out(h + self.experts(h, self.router(h).argmax(-1)))


class FrozenMLP(MLP):
    """An MLP whose first layer is frozen (requires_grad=False, in no optimizer)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1.requires_grad_(False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class NormNet(nn.Module):
    """``embedding -> norm -> linear -> linear -> head``, the norm registered last so its
    weight shares the head's bucket: Inductor fuses the norm's weight multiply into the
    kernel that normalises, which ran before that bucket's wait (issue 13)."""

    def __init__(self, norm: str = "rms", vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.norm = RMSNorm(dim) if norm == "rms" else nn.LayerNorm(dim)
        with torch.no_grad():  # norm weights away from 1, so reading stale ones shows
            self.norm.weight.add_(0.1 * torch.randn(dim))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(F.relu(self.fc1(self.norm(self.emb(idx))))))


def _rope(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding over the last dim of ``[b, heads, t, head_dim]``."""
    t, half = x.shape[-2], x.shape[-1] // 2
    freqs = base ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = torch.arange(t, dtype=torch.float32)[:, None] * freqs
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class LlamaBlock(nn.Module):
    """RMSNorm, RoPE, grouped-query attention (4 query heads, 2 KV heads), SwiGLU."""

    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 2, hidden: int = 64) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w_gate, self.w_up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.wkv(h).view(b, t, 2 * self.kv_heads, self.head_dim).transpose(1, 2).chunk(2, dim=1)
        q, k = _rope(q), _rope(k)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.wo(y)
        h = self.mlp_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class Llama(nn.Module):
    """A tiny Llama: token embedding, blocks (one by default), final RMSNorm, untied head."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 1) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(LlamaBlock(dim) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(0.1 * torch.randn_like(p))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


MODELS = {
    "mlp": MLP,
    "gpt": GPT,
    "conv": ConvNet,
    "gpt_break": lambda: GPT(GPTArgs(graph_break=True, eager_head=True)),
    "gpt_loop_break": lambda: GPT(GPTArgs(loop_break=True)),
    "mlp_branch": BranchMLP,
    "mlp_frozen": FrozenMLP,
    "adapters": AdapterNet,
    "expert_loop": ExpertLoop,
    "rmsnet": NormNet,
    "lnnet": lambda: NormNet("layer"),
    "llama": Llama,
}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def kind(name: str) -> str:
    """Which data and loss a model takes."""
    tokens = name.startswith("gpt") or name in ("rmsnet", "lnnet", "llama")
    return "gpt" if tokens else "conv" if name == "conv" else "mlp"


def forward_kwargs(name: str, step: int) -> dict:
    return {"use_extra": step % 3 == 1} if name == "mlp_branch" else {}


def batch(name: str, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (identical on every rank and in the reference)."""
    g = torch.Generator().manual_seed(1000 + step)
    name = kind(name)
    if name == "conv":
        x = torch.randn(size, 3, 8, 8, generator=g)
        teacher = torch.randn(3, 10, generator=torch.Generator().manual_seed(7))
        return x, (x.mean(dim=(2, 3)) @ teacher).argmax(-1)
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
    if kind(name) == "mlp":
        return F.mse_loss(out, target)
    if kind(name) == "conv":
        return F.cross_entropy(out, target)
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def train_steps(
    name: str, forward: Callable[[torch.Tensor], torch.Tensor], opt: torch.optim.Optimizer, steps: Iterable[int],
    size: int, device: Optional[str] = None,
) -> list[float]:
    """Forward, backward, ``opt.step()``, ``opt.zero_grad()`` on ``batch(name, step, size)`` for
    each step (moved to ``device`` if given); the losses."""
    losses = []
    for step in steps:
        x, y = (t.to(device) for t in batch(name, step, size)) if device else batch(name, step, size)
        loss = loss_fn(name, forward(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


_Run = TypeVar("_Run")


def runs_from_initial_state(model: nn.Module, runs: Sequence[_Run], train: Callable[[_Run], Any]) -> list[Any]:
    """``train(run)`` for each of ``runs``, each from ``model``'s initial state (params and
    buffers such as BatchNorm statistics). Each ``train`` builds its own optimizer; once it
    is gone, the next one takes over the same compiled graphs (``test_binding.py``), so the
    runs execute the same generated code. Compile ``model`` with ``dynamic=False``: a graph a
    first run recompiled with dynamic shapes would otherwise serve a later run's first steps."""
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    results = []
    for run in runs:
        model.load_state_dict(initial)
        results.append(train(run))
        gc.collect()  # the run's optimizer is gone: the next one may manage the params
    return results


def rank_step(loss: torch.Tensor, opt: torch.optim.Optimizer) -> float:
    """Backward, a step that must not skip, ``zero_grad``; this step's loss averaged over ranks."""
    import torch.distributed as dist

    loss.backward()
    assert not opt.step().skipped
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def param_groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict]:
    """Two AdamW groups, as nanoGPT makes them: decay on matrices, none on the rest."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


RANK_SEED = 1234
"""Rank ``r`` of a multi-rank test seeds its generator with ``RANK_SEED + r`` before its first
step, as a training script that seeds ``base + rank`` does: its dropout masks are its own."""


def seed_rank(rank: int) -> None:
    torch.manual_seed(RANK_SEED + rank)


class RankGenerators:
    """Each rank's default-generator state, for a single-process reference of a multi-rank run:
    inside ``rank(r)`` random ops draw what rank ``r``'s process draws after ``seed_rank(r)``
    (the same ops in the same order: dropout masks then match eager's or Inductor's per rank)."""

    def __init__(self, world: int) -> None:
        saved = torch.get_rng_state()
        self.states = []
        for rank in range(world):
            seed_rank(rank)
            self.states.append(torch.get_rng_state())
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def rank(self, rank: int) -> Iterator[None]:
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states[rank])
        try:
            yield
        finally:
            self.states[rank] = torch.get_rng_state()
            torch.set_rng_state(saved)

    def mean_loss(self, loss_of_rank: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """The ranks' losses averaged (DDP's gradient), each computed with its rank's generator."""
        world = len(self.states)
        parts = []
        for rank in range(world):
            with self.rank(rank):
                parts.append(loss_of_rank(rank))
        return sum(parts) / world
