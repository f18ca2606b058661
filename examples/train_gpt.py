"""Train a small byte-level GPT with fxzero: ZeRO-1 AdamW + torch.compile(backend="fxzero").

    torchrun --nproc-per-node 2 examples/train_gpt.py    # 2 ranks (gloo on CPU, NCCL on GPU)
    python examples/train_gpt.py --steps 20 --compile none   # 1 rank, eager, no process group

Data: the Python standard library's own .py files (about 2 MB, read in sorted order),
or --data FILE; one token per byte. Each step draws a global batch of --global-batch
sequences from a generator seeded by the step number, and each rank trains on its
1/world slice of it, so the run does the same math at any world size.
"""

import argparse
import contextlib
import math
import os
import resource
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tabulate import tabulate

import fxzero


@dataclass
class ModelArgs:
    vocab_size: int = 256  # bytes
    block_size: int = 128
    dim: int = 256
    n_layer: int = 4
    n_head: int = 4


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_head = args.n_head
        self.wqkv = nn.Linear(args.dim, 3 * args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.wqkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, 4 * args.dim, bias=False)
        self.w2 = nn.Linear(4 * args.dim, args.dim, bias=False)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.feed_forward = FeedForward(args)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.block_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layer))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.output.weight = self.tok_embeddings.weight  # tied: one Parameter, two uses
        for name, p in self.named_parameters():  # nanoGPT's init
            if p.dim() == 2:
                residual = name.endswith(("wo.weight", "w2.weight"))
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * args.n_layer) if residual else 0.02)

    def forward(self, idx, targets):
        x = self.tok_embeddings(idx) + self.pos_embeddings(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.layers:
            x = layer(x)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def load_bytes(path, limit=2_000_000):
    if path:
        return Path(path).read_bytes()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for file in sorted(f for f in stdlib.rglob("*.py") if "site-packages" not in f.parts):
        chunks.append(file.read_bytes())
        total += len(chunks[-1])
        if total >= limit:
            break
    return b"\n".join(chunks)[:limit]


def windows(data, starts, seq, device):  # inputs and next-byte targets
    x = torch.stack([data[s : s + seq] for s in starts])
    y = torch.stack([data[s + 1 : s + 1 + seq] for s in starts])
    return x.to(device), y.to(device)


def get_batch(data, step, args, rank, world, device):
    """This rank's slice of global batch `step`: the same global batch at any world size."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(len(data) - args.seq - 1, (args.global_batch,), generator=g)
    per_rank = args.global_batch // world
    return windows(data, starts[rank * per_rank : (rank + 1) * per_rank], args.seq, device)


def lr_at(step, args):  # linear warmup, then cosine down to lr/10
    warmup = max(1, args.steps // 10)
    if step <= warmup:
        return args.lr * step / warmup
    return args.lr * (0.55 + 0.45 * math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))


def reduce(value, op, device):
    t = torch.tensor(float(value), dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=op)
    return t.item()


# ---- the run: arguments, process group, model and optimizer ----------------------------
def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step, over all ranks")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--bucket-size", type=int, default=1_000_000, help="elements per gradient bucket")
    p.add_argument("--compile", choices=["inductor", "eager", "none"], default="inductor",
                   help="fxzero's inner compiler, or none for no torch.compile")
    p.add_argument("--mxfp8", action="store_true", help="all-gather params as MXFP8 (into the grad buffer)")
    p.add_argument("--overlap", action="store_true",
                   help="overlap the param gathers with the next forward (opt-in; default: step() gathers them)")
    p.add_argument("--accum", type=int, default=1, help="microbatches per step")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--data", default=None, help="a text file (default: the stdlib's .py files)")
    p.add_argument("--ckpt-dir", default=None, help="resume from the latest checkpoint here; save into it")
    p.add_argument("--ckpt-every", type=int, default=0, help="save every N steps (and at the end) when --ckpt-dir is set")
    return p


def init_distributed():
    """(rank, world, device): a process group when launched by torchrun, else rank 0 of 1."""
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, os.cpu_count() // world))
    return rank, world, device


@dataclass
class Job:
    """What one rank trains with."""
    args: argparse.Namespace
    rank: int
    world: int
    device: torch.device
    model: Transformer  # the module: checkpoints and validation
    train_model: nn.Module  # what the training steps call: the model, compiled unless --compile none
    opt: fxzero.DistributedOptimizer
    train_data: torch.Tensor
    val_data: torch.Tensor
    log: Callable[..., None]  # prints on rank 0 only


def build_optimizer(model, args):
    params = list(model.parameters())  # the tied embedding/head weight appears once
    groups = [  # weight decay on matrices (and the embedding) only
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return fxzero.DistributedOptimizer(
        groups, torch.optim.AdamW, lr=args.lr, betas=(0.9, 0.95), process_group=None,
        config=fxzero.Config(bucket_size=args.bucket_size, clip_grad=1.0, overlap_param_gather=args.overlap,
                             mxfp8_param_gather=args.mxfp8, reuse_grad_buf_for_mxfp8_param_ag=args.mxfp8),
        module=model,  # lay buckets out in registration order (the groups split the model)
    )


def build_job(args, rank, world, device):
    data = torch.frombuffer(bytearray(load_bytes(args.data)), dtype=torch.uint8).long()
    split = int(0.9 * len(data))
    torch.manual_seed(0)  # same init on every rank
    model_args = ModelArgs(block_size=args.seq, dim=args.dim, n_layer=args.layers, n_head=args.heads)
    model = Transformer(model_args).to(device)
    opt = build_optimizer(model, args)
    train_model = model  # fxzero's passes put each bucket's reduce-scatter and all-gather wait into the graphs
    if args.compile != "none":
        train_model = torch.compile(model, backend="fxzero", options={"inner_compiler": args.compile})
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    return Job(args, rank, world, device, model, train_model, opt, data[:split], data[split:], log)


# ---- training ---------------------------------------------------------------------------
def train_step(job, step, loss_sum):
    """One optimizer step on global batch `step`; adds its loss (this rank's mean) to loss_sum."""
    args, opt = job.args, job.opt
    for group in opt.param_groups:
        group["lr"] = lr_at(step, args)
    x, y = get_batch(job.train_data, step, args, job.rank, job.world, job.device)
    micro = args.global_batch // job.world // args.accum
    for i in range(args.accum):
        # All but the last microbatch only accumulate into main_grad; the last
        # backward launches each bucket's reduce-scatter as soon as its grads are in.
        with opt.no_sync() if i < args.accum - 1 else contextlib.nullcontext():
            loss = job.train_model(x[i * micro : (i + 1) * micro], y[i * micro : (i + 1) * micro]) / args.accum
            loss.backward()
        loss_sum += loss.detach()
    result = opt.step()  # finish reduce-scatters, AdamW on this rank's shard, all-gather
    opt.zero_grad()
    return result


def train(job):
    """Steps from the first one not checkpointed to --steps: (logged mean losses, skipped steps, first logged ms/step)."""
    args, device = job.args, job.device
    tokens_per_step = args.global_batch * args.seq
    losses, skipped, first_ms = [], 0, 0.0
    loss_sum, n_sum, t_last = torch.zeros((), device=device), 0, time.perf_counter()
    for step in range(resume(args.ckpt_dir, job.model, job.opt, job.log), args.steps + 1):
        skipped += train_step(job, step, loss_sum).skipped
        if args.ckpt_dir and (step == args.steps or (args.ckpt_every and step % args.ckpt_every == 0)):
            fxzero.save_checkpoint(args.ckpt_dir, job.model, job.opt, step=step)  # every rank writes its shard
        n_sum += 1
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            mean_loss = reduce(loss_sum, dist.ReduceOp.SUM, device) / (job.world * n_sum)  # one scalar all-reduce
            now = time.perf_counter()
            ms = 1000 * (now - t_last) / n_sum
            losses.append(mean_loss)
            job.log(f"step {step:4d} | loss {mean_loss:.4f} | {ms:4.0f} ms/step | {tokens_per_step / ms * 1000:,.0f} tok/s")
            first_ms = first_ms or ms  # the first step compiles
            loss_sum.zero_()
            n_sum, t_last = 0, now
    return losses, skipped, first_ms


def validate(job):
    """Mean loss over non-overlapping windows of the held-out 10%, split over ranks."""
    job.model.eval()
    seq, val_data = job.args.seq, job.val_data
    val_starts = torch.arange(0, len(val_data) - seq - 1, seq)[:256]
    val_sum = 0.0
    with torch.no_grad():
        for chunk in val_starts[job.rank :: job.world].split(32):
            val_sum += job.model(*windows(val_data, chunk, seq, job.device)).item() * len(chunk)
    return reduce(val_sum, dist.ReduceOp.SUM, job.device) / len(val_starts)


# ---- the summary table ------------------------------------------------------------------
def summary(job, losses, val_loss, skipped, first_ms, t_start):
    args, opt, device, world = job.args, job.opt, job.device, job.world
    n_params = sum(p.numel() for p in job.model.parameters())
    on_gpu = device.type == "cuda"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # ru_maxrss is KiB on Linux
    peak = reduce(torch.cuda.max_memory_allocated(device) if on_gpu else rss, dist.ReduceOp.MAX, device)
    state = reduce(opt.state_bytes, dist.ReduceOp.MAX, device)
    n_buckets, padded = len(opt.buckets), sum(b.plan.numel for b in opt.buffers)
    unpadded = sum(b.plan.numel_unpadded for b in opt.buffers)
    counts = opt.collectives_per_step  # c10d op names: gloo reduces by all-to-all chunks, gathers by broadcasts
    collectives = f"{sum(counts.values())} (" + " + ".join(f"{n} {op}" for op, n in sorted(counts.items())) + ")"
    setup = (f"world {world}, compile {args.compile}, param-gather overlap {'on' if args.overlap else 'off'}, "
             f"MXFP8 gather {'on (in the grad buffer)' if args.mxfp8 else 'off'}")
    rows = [
        ("setup", setup),
        ("train loss (first → last)", f"{losses[0]:.4f} → {losses[-1]:.4f}" if losses else "none (resumed at the end)"),
        ("val loss", f"{val_loss:.4f}"),
        ("params", f"{n_params:,}"),
        ("buckets", f"{n_buckets} (bucket size {args.bucket_size:,}; buffer {padded:,} elems, {unpadded:,} unpadded)"),
        ("collectives per step", collectives if world > 1 else "0 (world size 1)"),
        ("optimizer state / rank (max)", f"{state / 2**20:.2f} MiB (plain AdamW: {8 * n_params / 2**20:.2f} MiB)"),
        ("peak memory / rank (max)", f"{peak / 2**20:.0f} MiB ({'cuda allocated' if on_gpu else 'max RSS'})"),
        ("skipped steps", skipped),
        ("steps × tokens/step", f"{args.steps} × {args.global_batch * args.seq:,}"),
        ("first step (compiles)", f"{first_ms / 1000:.1f} s"),
        ("wall time", f"{time.perf_counter() - t_start:.1f} s"),
    ]
    return tabulate(rows, headers=["", "value"], tablefmt="github")


# ---- checkpoints ------------------------------------------------------------------------
def resume(ckpt_dir, model, opt, log):
    """The first step to run: 1, or the one after the latest checkpoint in ckpt_dir (saved at
    any world size). Batches and the LR are pure functions of the step, so a resumed run
    repeats exactly what an uninterrupted one would have done."""
    path = fxzero.latest_checkpoint(ckpt_dir) if ckpt_dir else None
    if path is None:
        return 1
    step = fxzero.load_checkpoint(path, model, opt)["step"]
    log(f"resumed from {path} (step {step})")
    return step + 1


def main():
    parser = build_parser()
    args = parser.parse_args()
    t_start = time.perf_counter()
    rank, world, device = init_distributed()
    if args.global_batch % (world * args.accum):
        parser.error(f"--global-batch {args.global_batch} must be divisible by world * accum = {world * args.accum}")
    job = build_job(args, rank, world, device)
    n_params = sum(p.numel() for p in job.model.parameters())
    job.log(f"fxzero GPT: {n_params:,} params, {len(job.opt.buckets)} buckets, world {world}, {device.type}, "
            f"{len(job.train_data):,} train / {len(job.val_data):,} val bytes")
    losses, skipped, first_ms = train(job)
    val_loss = validate(job)
    job.log(summary(job, losses, val_loss, skipped, first_ms, t_start))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
