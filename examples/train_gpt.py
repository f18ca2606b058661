"""Train a small byte-level GPT with fxzero: ZeRO-1 AdamW + torch.compile(backend="fxzero").

    torchrun --nproc-per-node 2 examples/train_gpt.py    # 2 ranks (gloo on CPU, NCCL on GPU)
    python examples/train_gpt.py --steps 20 --compile none   # 1 rank, eager, no process group
    torchrun --nproc-per-node 2 examples/train_gpt.py --optimizer muon   # Muon on the blocks' matrices
    torchrun --nproc-per-node 4 examples/train_gpt.py --tp 2   # dp 2 x tp 2

With --optimizer muon, two DistributedOptimizers share the model: torch.optim.Muon over the
attention and MLP matrices (each owned whole by one rank: Muon orthogonalizes a matrix's whole
update) and AdamW over the embeddings (tied to the head), the norms and their biases.

With --tp N, the ranks form a (dp = world / N) x (tp = N) DeviceMesh: each block's attention
and MLP are tensor-parallel (DTensor params, Megatron's column/row split) over "tp", and
fxzero's ZeRO-1 runs over "dp", compiled or not, with every flag but --optimizer muon.

It reports like torchtitan's logger (examples/train_log.py): a "compiling" line before the first
step, then per logged step: step k/N, loss, lr, grad norm, tok/s, peak memory, ETA;
--metrics FILE also writes them as JSON lines, --tensorboard DIR as TensorBoard scalars.

Data: the Python standard library's own .py files (about 2 MB, read in sorted order),
or --data FILE; one token per byte. Each step draws a global batch of --global-batch
sequences from a generator seeded by the step number, and each data-parallel rank trains on
its 1/dp slice of it (the TP ranks of one dp rank on the same slice), so the run does the
same math at any world size and TP degree.
"""

import argparse
import collections
import contextlib
import math
import os
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tabulate import tabulate
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import fxzero
from train_log import TENSORBOARD_MISSING, TrainLog, machine, peak_memory, tensorboard_missing


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
        self.head_dim = args.dim // args.n_head
        self.wqkv = nn.Linear(args.dim, 3 * args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape  # under TP, wqkv gives this rank's heads only (see shard_qkv_rows): -1 below
        q, k, v = self.wqkv(x).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


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


# ---- tensor parallelism (--tp) -----------------------------------------------------------
def shard_qkv_rows(wqkv: nn.Linear, tp: int) -> None:
    """Reorder the fused wqkv's output rows from [q; k; v] to [q_0; k_0; v_0; q_1; ...], where
    q_r holds TP rank r's heads, so that ColwiseParallel's contiguous row shard on rank r is
    [q_r; k_r; v_r] (gpt-fast shards its fused wqkv the same way). A relabeling of the
    outputs that the forward undoes: the model computes the same function."""
    w = wqkv.weight
    with torch.no_grad():  # reshape of the transposed view copies: no aliasing with w
        w.copy_(w.view(3, tp, -1, w.shape[1]).transpose(0, 1).reshape(w.shape))


def parallelize(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Megatron-style TP over ``tp_mesh``: in each block, wqkv and w1 ColwiseParallel (each
    rank computes its heads / its slice of the hidden units), wo and w2 RowwiseParallel (one
    all-reduce after each). The embeddings, the tied head and the LayerNorms stay plain
    params, replicated on every TP rank (fxzero counts them once in the global norm). Imported
    here: torch's tensor parallelism costs a process ~1 s to import, and only --tp > 1 uses it."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for layer in model.layers:
        shard_qkv_rows(layer.attention.wqkv, tp_mesh.size())
        parallelize_module(layer, tp_mesh, {
            "attention.wqkv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        })  # fmt: skip


def local_numel(p: torch.Tensor) -> int:
    """Elements this rank holds of ``p`` (its local shard for a DTensor: one has ``to_local``)."""
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


def _stdlib_sources(root):
    """The standard library's .py files, not walking site-packages (tens of thousands of files: 0.7 s)."""
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [name for name in subfolders if name != "site-packages"]
        yield from (Path(folder, name) for name in files if name.endswith(".py"))


def load_bytes(path, limit=2_000_000):
    if path:
        return Path(path).read_bytes()
    chunks, total = [], 0
    for file in sorted(_stdlib_sources(Path(sysconfig.get_paths()["stdlib"]))):
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
    """Slice `rank` of `world` (the data-parallel rank and size) of global batch `step`: the
    same global batch at any world size."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(len(data) - args.seq - 1, (args.global_batch,), generator=g)
    per_rank = args.global_batch // world
    return windows(data, starts[rank * per_rank : (rank + 1) * per_rank], args.seq, device)


def lr_at(step, args):  # linear warmup, then cosine down to lr/10
    warmup = max(1, args.steps // 10)
    if step <= warmup:
        return args.lr * step / warmup
    return args.lr * (0.55 + 0.45 * math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))


def reduce(value, op, device, group=None):
    t = torch.tensor(float(value), dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=op, group=group)
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
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw",
                   help="muon: torch.optim.Muon on the blocks' matrices, AdamW (same lr) on the rest")
    p.add_argument("--bucket-size", type=int, default=1_000_000, help="elements per gradient bucket")
    p.add_argument("--compile", choices=["inductor", "eager", "none"], default="inductor",
                   help="fxzero's inner compiler, or none for no torch.compile")
    p.add_argument("--mxfp8", action="store_true", help="all-gather params as MXFP8 (into the grad buffer)")
    p.add_argument("--overlap", action="store_true",
                   help="overlap the param gathers with the next forward (opt-in; default: step() gathers them)")
    p.add_argument("--accum", type=int, default=1, help="microbatches per step")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--metrics", default=None, metavar="FILE", help="write each logged step as a JSON line here (rank 0)")
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="write TensorBoard scalars here (rank 0; needs the tensorboard package: the [tensorboard] extra)")
    p.add_argument("--data", default=None, help="a text file (default: the stdlib's .py files)")
    p.add_argument("--ckpt-dir", default=None, help="resume from the latest checkpoint here; save into it")
    p.add_argument("--ckpt-every", type=int, default=0, help="save every N steps (and at the end) when --ckpt-dir is set")
    p.add_argument("--instances", type=int, default=1,
                   help="hierarchical sharding: optimizer state sharded inside each of this many instances "
                        "(consecutive ranks: under torchrun, one per node) and replicated across them")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: a (world / tp) x tp mesh, ZeRO-1 over dp")
    return p


TP_UNSUPPORTED = {  # flag -> why it is refused with --tp > 1
    "--optimizer muon": "Muon owns each matrix whole, and TP shards the blocks' matrices",
}


def check_args(parser, args, world):
    """Refuse (parser.error, naming the flag) what this run cannot do."""
    tp = args.tp
    if tp < 1 or world % tp:
        parser.error(f"--tp {tp} must divide the world size {world}")
    if tp > 1:
        if args.heads % tp:
            parser.error(f"--tp {tp} must divide --heads {args.heads} (each TP rank computes whole heads)")
        used = {"--optimizer muon": args.optimizer == "muon"}
        for flag, why in TP_UNSUPPORTED.items():
            if used[flag]:
                parser.error(f"{flag} is not supported with --tp {tp} yet: {why}")
    if args.instances != 1:
        if args.instances < 1 or world % args.instances:
            parser.error(f"--instances {args.instances} must divide the world size {world}")
        for flag, used in (("--tp", tp > 1), ("--optimizer muon", args.optimizer == "muon")):
            if used:
                parser.error(f"--instances {args.instances} is not supported with {flag}")
    if args.tensorboard and tensorboard_missing():
        parser.error(TENSORBOARD_MISSING)
    dp = world // tp
    if args.global_batch % (dp * args.accum):
        what = "world * accum" if tp == 1 else f"dp * accum (dp = world / tp = {dp})"
        parser.error(f"--global-batch {args.global_batch} must be divisible by {what} = {dp * args.accum}")


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
    opts: dict[str, fxzero.DistributedOptimizer]  # by name ("adamw", "muon"): each owns some of the params
    train_data: torch.Tensor
    val_data: torch.Tensor
    log: Callable[..., None]  # prints on rank 0 only
    mesh: Optional[DeviceMesh] = None  # the (dp, tp) mesh with --tp > 1, else None (plain data parallelism)

    @property
    def dp(self) -> int:
        return self.world // self.args.tp

    @property
    def dp_rank(self) -> int:
        return self.rank if self.mesh is None else self.mesh["dp"].get_local_rank()

    @property
    def dp_group(self) -> Optional[dist.ProcessGroup]:
        return None if self.mesh is None else self.mesh["dp"].get_group()


CLIP = 1.0  # max global grad norm


def fxzero_config(args, clip_grad):
    return fxzero.Config(bucket_size=args.bucket_size, clip_grad=clip_grad, overlap_param_gather=args.overlap,
                         mxfp8_param_gather=args.mxfp8, reuse_grad_buf_for_mxfp8_param_ag=args.mxfp8)


def build_adamw(model, params, args, clip_grad, group=None):
    groups = [  # weight decay on matrices (and the embedding) only
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return fxzero.DistributedOptimizer(
        groups, torch.optim.AdamW, lr=args.lr, betas=(0.9, 0.95), process_group=group,  # mesh["dp"] with --tp
        config=fxzero_config(args, clip_grad),
        module=model,  # lay buckets out in registration order (the groups split the model)
    )


def build_muon(model, params, args):
    """Muon orthogonalizes each matrix's whole update, so fxzero gives every matrix whole to one
    rank (Config.state_sharding="auto" does for Muon). adjust_lr_fn="match_rms_adamw" scales the
    update to AdamW's RMS (Moonshot's "Muon is Scalable for LLM Training"), so Muon takes AdamW's
    lr, schedule and weight decay."""
    return fxzero.DistributedOptimizer(
        params, torch.optim.Muon, lr=args.lr, weight_decay=0.1, adjust_lr_fn="match_rms_adamw",
        process_group=None, config=fxzero_config(args, None), module=model,
    )


def build_optimizers(model, args, group=None):
    """{name: optimizer}. AdamW alone clips in step() (Config.clip_grad); two optimizers would each
    clip by the norm of their own params, so train_step clips by the whole model's norm instead.
    ``group``: the data-parallel dimension of the mesh with --tp, else None (the world)."""
    params = list(model.parameters())  # the tied embedding/head weight appears once
    if args.optimizer == "adamw":
        return {"adamw": build_adamw(model, params, args, clip_grad=CLIP, group=group)}
    hidden = {id(p) for p in model.layers.parameters() if p.dim() == 2}  # attention and MLP matrices
    return {
        "muon": build_muon(model, [p for p in params if id(p) in hidden], args),
        "adamw": build_adamw(model, [p for p in params if id(p) not in hidden], args, clip_grad=None),
    }


def build_job(args, rank, world, device):
    data = torch.frombuffer(bytearray(load_bytes(args.data)), dtype=torch.uint8).long()
    split = int(0.9 * len(data))
    torch.manual_seed(0)  # same init on every rank
    model_args = ModelArgs(block_size=args.seq, dim=args.dim, n_layer=args.layers, n_head=args.heads)
    model = Transformer(model_args).to(device)
    mesh = None
    if args.tp > 1:  # before the optimizer: fxzero's buffers take the DTensors' local shards
        mesh = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        parallelize(model, mesh["tp"])
    group = None if mesh is None else mesh["dp"]
    if args.instances > 1:  # ranks r*k .. r*k+k-1 form instance r: torchrun numbers a node's ranks consecutively
        group = init_device_mesh(device.type, (args.instances, world // args.instances), mesh_dim_names=("replicate", "shard"))
    opts = build_optimizers(model, args, group=group)
    train_model = model  # fxzero's passes put each bucket's reduce-scatter and all-gather wait into the graphs
    if args.compile != "none":
        train_model = torch.compile(model, backend="fxzero", options={"inner_compiler": args.compile})
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    return Job(args, rank, world, device, model, train_model, opts, data[:split], data[split:], log, mesh)


# ---- training ---------------------------------------------------------------------------
def no_sync(opts):
    """Every optimizer's no_sync(): grads only accumulate into main_grad."""
    stack = contextlib.ExitStack()
    for opt in opts:
        stack.enter_context(opt.no_sync())
    return stack


def train_step(job, step, loss_sum):
    """One optimizer step on global batch `step`; adds its loss (this rank's mean) to loss_sum.
    Returns (whether the step was skipped: a non-finite gradient norm, the global gradient norm
    before clipping)."""
    args, opts = job.args, list(job.opts.values())
    for opt in opts:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
    x, y = get_batch(job.train_data, step, args, job.dp_rank, job.dp, job.device)
    micro = args.global_batch // job.dp // args.accum
    for i in range(args.accum):
        # All but the last microbatch only accumulate into main_grad; the last
        # backward launches each bucket's reduce-scatter as soon as its grads are in.
        with no_sync(opts) if i < args.accum - 1 else contextlib.nullcontext():
            loss = job.train_model(x[i * micro : (i + 1) * micro], y[i * micro : (i + 1) * micro]) / args.accum
            loss.backward()
        loss_sum += loss.detach()
    norm = None
    if len(opts) > 1:  # p.grad views every rank's shards: the global norm, one all-reduce per optimizer
        norm = float(torch.nn.utils.clip_grad_norm_(job.model.parameters(), CLIP))
    results = [opt.step() for opt in opts]  # finish reduce-scatters, update this rank's shard, all-gather
    for opt in opts:
        opt.zero_grad()
    # one optimizer: StepResult.grad_norm is the whole model's, before Config.clip_grad; two found
    # the norms of their own params after the clip above, whose norm is the whole model's
    return any(r.skipped for r in results), results[0].grad_norm if norm is None else norm


def describe(job):
    """The run, as the metrics file's first line holds it (and the loss curve's caption shows)."""
    args = job.args
    n_params = sum(p.numel() for p in job.model.parameters())
    setup = f"{optimizer_names(job.opts)}, compile {args.compile}" + (f", tp {args.tp}" if args.tp > 1 else "")
    return {"machine": machine(job.device), "world": job.world, "device": job.device.type, "setup": setup,
            "model": f"GPT {n_params / 1e6:.2f}M params (dim {args.dim}, {args.layers} layers, seq {args.seq})"}


def train(job):
    """Steps from the first one not checkpointed to --steps: (logged mean losses, skipped steps, first logged ms/step)."""
    args, device = job.args, job.device
    log = TrainLog(args.steps, args.global_batch * args.seq, device, describe(job), enabled=job.rank == 0,
                   compiles=args.compile != "none", metrics=args.metrics, tensorboard=args.tensorboard)
    losses, skipped, first_ms = [], 0, 0.0
    loss_sum, n_sum, first = torch.zeros((), device=device), 0, resume(job)
    log.start(first, args.compile)
    for step in range(first, args.steps + 1):
        was_skipped, grad_norm = train_step(job, step, loss_sum)
        skipped += was_skipped
        if args.ckpt_dir and (step == args.steps or (args.ckpt_every and step % args.ckpt_every == 0)):
            save(job, step)
        n_sum += 1
        if step == first or step % args.log_every == 0 or step == args.steps:
            mean_loss = reduce(loss_sum, dist.ReduceOp.SUM, device, job.dp_group) / (job.dp * n_sum)  # one scalar all-reduce
            losses.append(mean_loss)
            record = log.step(step, mean_loss, lr_at(step, args), grad_norm)
            first_ms = first_ms or record["ms_per_step"]  # the first step compiles
            loss_sum.zero_()
            n_sum = 0
    log.close()
    return losses, skipped, first_ms


def validate(job):
    """Mean loss over non-overlapping windows of the held-out 10%, split over ranks."""
    job.model.eval()
    seq, val_data = job.args.seq, job.val_data
    val_starts = torch.arange(0, len(val_data) - seq - 1, seq)[:256]
    val_sum = 0.0
    with torch.no_grad():
        for chunk in val_starts[job.dp_rank :: job.dp].split(32):  # a dp rank's TP ranks: the same chunks
            val_sum += job.model(*windows(val_data, chunk, seq, job.device)).item() * len(chunk)
    return reduce(val_sum, dist.ReduceOp.SUM, job.device, job.dp_group) / len(val_starts)


# ---- the summary table ------------------------------------------------------------------
def optimizer_names(opts):
    return " + ".join(opt.optimizer_class.__name__ for opt in opts.values())


def unsharded_state_bytes(opts):
    """What torch.optim would hold on every rank: AdamW two fp32 moments, Muon one momentum buffer
    (with --tp, of this rank's TP shards)."""
    per_elem = {torch.optim.AdamW: 8, torch.optim.Muon: 4}
    return sum(per_elem[opt.optimizer_class] * local_numel(p) for opt in opts.values() for p in opt.param_table.params)


def summary(job, losses, val_loss, skipped, first_ms, t_start):
    args, opts, device, world = job.args, job.opts.values(), job.device, job.world
    n_params = sum(p.numel() for p in job.model.parameters())
    memory, kind = peak_memory(device)
    peak = reduce(memory, dist.ReduceOp.MAX, device)
    state = reduce(sum(opt.state_bytes for opt in opts), dist.ReduceOp.MAX, device)
    buffers = [b for opt in opts for b in opt.buffers]
    n_buckets, padded = sum(len(opt.runtime.buckets) for opt in opts), sum(b.plan.numel for b in buffers)
    unpadded = sum(b.plan.numel_unpadded for b in buffers)
    counts = collections.Counter()  # c10d op names: gloo reduces by all-to-all chunks, gathers by broadcasts
    for opt in opts:
        counts.update(opt.collectives_per_step)
    collectives = f"{sum(counts.values())} (" + " + ".join(f"{n} {op}" for op, n in sorted(counts.items())) + ")"
    if job.mesh is not None:
        collectives += ", fxzero's (the TP layers' own all-reduces not counted)"
    mesh = "" if job.mesh is None else f" (dp {job.dp} x tp {args.tp})"
    if args.instances > 1:
        mesh = f" ({args.instances} instances x {world // args.instances} shards)"
    setup = (f"world {world}{mesh}, compile {args.compile}, param-gather overlap {'on' if args.overlap else 'off'}, "
             f"MXFP8 gather {'on (in the grad buffer)' if args.mxfp8 else 'off'}")
    if len(job.opts) > 1:
        setup += f", {optimizer_names(job.opts)}"
    rows = [
        ("setup", setup),
        ("train loss (first → last)", f"{losses[0]:.4f} → {losses[-1]:.4f}" if losses else "none (resumed at the end)"),
        ("val loss", f"{val_loss:.4f}"),
        ("params", f"{n_params:,}"),
        ("buckets", f"{n_buckets} (bucket size {args.bucket_size:,}; buffer {padded:,} elems, {unpadded:,} unpadded)"),
        ("collectives per step", collectives if world > 1 else "0 (world size 1)"),
        ("optimizer state / rank (max)",
         f"{state / 2**20:.2f} MiB (plain {optimizer_names(job.opts)}: {unsharded_state_bytes(job.opts) / 2**20:.2f} MiB)"),
        ("peak memory / rank (max)", f"{peak / 2**20:.0f} MiB ({kind})"),
        ("skipped steps", skipped),
        ("steps × tokens/step", f"{args.steps} × {args.global_batch * args.seq:,}"),
        ("first step (compiles)", f"{first_ms / 1000:.1f} s"),
        ("wall time", f"{time.perf_counter() - t_start:.1f} s"),
    ]
    return tabulate(rows, headers=["", "value"], tablefmt="github")


# ---- checkpoints ------------------------------------------------------------------------
def checkpoint_dirs(job):
    """{optimizer name: directory}: --ckpt-dir itself for one optimizer, a subdirectory each for two
    (a checkpoint holds the model and one optimizer)."""
    if len(job.opts) == 1:
        return {name: Path(job.args.ckpt_dir) for name in job.opts}
    return {name: Path(job.args.ckpt_dir) / name for name in job.opts}


def save(job, step):
    for opt in job.opts.values():  # every param current in the model state each checkpoint holds
        opt.finish_param_sync()
    for name, directory in checkpoint_dirs(job).items():
        fxzero.save_checkpoint(directory, job.model, job.opts[name], step=step)  # every rank writes its shard


def resume(job):
    """The first step to run: 1, or the one after the latest checkpoint in --ckpt-dir (saved at
    any world size). Batches and the LR are pure functions of the step, so a resumed run
    repeats exactly what an uninterrupted one would have done. With two optimizers, a run
    killed between their saves resumes from the latest step both saved."""
    if not job.args.ckpt_dir:
        return 1
    dirs = checkpoint_dirs(job)
    latest = [fxzero.latest_checkpoint(directory) for directory in dirs.values()]
    if any(path is None for path in latest):
        return 1
    step = min(int(path.name.removeprefix("step_")) for path in latest)
    paths = {name: directory / f"step_{step:07d}" for name, directory in dirs.items()}
    for name, path in paths.items():
        fxzero.load_checkpoint(path, job.model, job.opts[name])
    job.log(f"resumed from {', '.join(map(str, paths.values()))} (step {step})")
    return step + 1


def main():
    parser = build_parser()
    args = parser.parse_args()
    t_start = time.perf_counter()
    rank, world, device = init_distributed()
    check_args(parser, args, world)
    job = build_job(args, rank, world, device)
    n_params = sum(p.numel() for p in job.model.parameters())
    n_buckets = sum(len(opt.runtime.buckets) for opt in job.opts.values())
    mesh = "" if job.mesh is None else f" (dp {job.dp} x tp {args.tp})"
    job.log(f"fxzero GPT: {n_params:,} params, {n_buckets} buckets, world {world}{mesh}, {device.type}, "
            f"{len(job.train_data):,} train / {len(job.val_data):,} val bytes")
    if len(job.opts) > 1:
        job.log(" + ".join(f"{opt.optimizer_class.__name__} over {sum(p.numel() for p in opt.param_table.params):,} params"
                           for opt in job.opts.values()))
        for opt in job.opts.values():
            if opt.runtime.whole_params:
                job.log(f"{opt.optimizer_class.__name__}: {opt.balance.describe()}")
    losses, skipped, first_ms = train(job)
    val_loss = validate(job)
    job.log(summary(job, losses, val_loss, skipped, first_ms, t_start))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
