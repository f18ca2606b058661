"""The rank side of ``compare.py``: build each config, train it alone, or train several interleaved.

Every config trains the GPT of ``examples/train_gpt.py`` on the same stdlib-bytes batches
from the same seed, with AdamW (lr 2e-3, betas 0.9/0.95, weight decay 0.1 on matrices).
These functions run on every rank of a :mod:`fxzero.testing` pool (gloo, 1 thread per rank).
"""

from __future__ import annotations

import collections
import contextlib
import os
import resource
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_gpt import ModelArgs, Transformer, get_batch, load_bytes  # noqa: E402

import fxzero  # noqa: E402
import fxzero.graph_compiler  # noqa: E402
from fxzero._torch_compat import InductorCompilers  # noqa: E402
from fxzero.optim.gradients.grad_reductions import GradReductions  # noqa: E402

LR, BETAS, PER_RANK = 2e-3, (0.9, 0.95), 8
CONFIGS = ("fxzero", "fxzero + overlap", "fxzero eager-inner", "DDP eager", "DDP + compile", "DDP + ZeRO", "FSDP2", "FSDP2 + compile", "limit")


def param_groups(model: torch.nn.Module) -> list[dict]:
    params = list(model.parameters())  # the tied weight appears once
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _state_nbytes(state: dict) -> int:
    from torch.distributed.tensor import DTensor

    values = (v.to_local() if isinstance(v, DTensor) else v for s in state.values() for v in s.values())
    return sum(v.nbytes for v in values if isinstance(v, torch.Tensor))


class _NoOptimizer:
    """The limit's optimizer: no update, but grads are dropped like everyone else's
    (accumulating them would add a pass over every gradient to the floor)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)


def build(config: str, model: torch.nn.Module, bucket_size, *, group=None, device_ids=None):
    """(callable model, optimizer, () -> optimizer-state bytes on this rank).

    Besides :data:`CONFIGS`: ``"fxzero eager"`` (the optimizer without torch.compile),
    ``"DDP gabv"`` (``DDP(gradient_as_bucket_view=True)``; ``"DDP gabv + compile"``,
    ``"DDP gabv + aot_eager"``: compiled with Inductor / ``backend="aot_eager"``), ``"floor"`` (forward and
    backward of the eager model, no optimizer). ``group``: the process group every
    wrapper and optimizer uses (default: the world); ``device_ids``: DDP's, on a GPU."""
    AdamW = torch.optim.AdamW
    if config.startswith("fxzero"):
        cfg = fxzero.Config(bucket_size=bucket_size, overlap_param_gather=config == "fxzero + overlap")
        opt = fxzero.DistributedOptimizer(param_groups(model), AdamW, lr=LR, betas=BETAS, config=cfg, module=model, process_group=group)
        if config == "fxzero eager":
            return model, opt, lambda: opt.state_bytes
        options = {"inner_compiler": "eager"} if config == "fxzero eager-inner" else {}
        return torch.compile(model, backend="fxzero", options=options), opt, lambda: opt.state_bytes
    if config in ("limit", "floor"):
        return (torch.compile(model) if config == "limit" else model), _NoOptimizer(model), lambda: 0
    if config.startswith("FSDP2"):
        from torch.distributed.fsdp import fully_shard

        mesh = None
        if group is not None:
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh.from_group(group, next(model.parameters()).device.type)
        for block in model.layers:
            fully_shard(block, reshard_after_forward=False, mesh=mesh)
        fully_shard(model, reshard_after_forward=False, mesh=mesh)
        opt = AdamW(param_groups(model), lr=LR, betas=BETAS)
        return (torch.compile(model) if "compile" in config else model), opt, lambda: _state_nbytes(opt.state)
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, device_ids=device_ids, process_group=group, gradient_as_bucket_view=config.startswith("DDP gabv"))
    if config.startswith("DDP + ZeRO"):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(param_groups(model), optimizer_class=AdamW, lr=LR, betas=BETAS, process_group=group)
        return ddp, opt, lambda: _state_nbytes(opt.optim.state)
    opt = AdamW(param_groups(model), lr=LR, betas=BETAS)
    if config.endswith("aot_eager"):  # AOTAutograd + FX code: the stack of fxzero's eager inner compiler
        return torch.compile(ddp, backend="aot_eager"), opt, lambda: _state_nbytes(opt.state)
    return (torch.compile(ddp) if "compile" in config else ddp), opt, lambda: _state_nbytes(opt.state)


def _payload(event) -> int:
    """Bytes of a c10d op's payload: its largest tensor among the first two arguments."""
    sizes = []
    for shape, dtype in zip(event.structured_input_shapes[:2], event.input_dtypes[:2]):
        shapes = shape if shape and isinstance(shape[0], list) else [shape]
        itemsize = 4 if dtype in ("TensorList", "") else torch.empty(0, dtype=_DTYPES.get(dtype, torch.float32)).element_size()
        sizes.append(sum(itemsize * _numel(s) for s in shapes if s))
    return max(sizes, default=0)


_DTYPES = {"float": torch.float32, "c10::BFloat16": torch.bfloat16, "unsigned char": torch.uint8, "double": torch.float64}


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@contextlib.contextmanager
def _count_collectives(out: dict):
    """Count c10d ops and their bytes (the profiler's start/stop banners on fd 2 are muted)."""
    from torch.profiler import ProfilerActivity, profile

    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved), os.close(devnull)
    for event in prof.events():
        if event.name.startswith("c10d::") and "barrier" not in event.name:
            op = event.name[len("c10d::"):].strip("_").replace("_base", "")
            out["collectives"][op] += 1
            out["bytes"] += _payload(event)


@contextlib.contextmanager
def _patched(owner, name: str, make):
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _timer(acc: dict, key: str):
    def make(fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[key] = acc.get(key, 0.0) + time.perf_counter() - start

        return timed

    return make


def _instrument_fxzero(stack: contextlib.ExitStack, out: dict, launches: list) -> None:
    """Time fxzero's passes vs Inductor's compilers; record reduce-scatter launch times."""
    for name in ("run_joint_passes", "run_forward_passes", "run_backward_passes"):
        stack.enter_context(_patched(fxzero.graph_compiler, name, _timer(out["compile"], "passes")))
    for name in ("forward", "backward"):
        stack.enter_context(_patched(InductorCompilers, name, _timer(out["compile"], "inductor")))

    def record(launch):
        def timed(reductions, indices):
            now = time.perf_counter()
            launches.extend((index, now) for index in indices)
            return launch(reductions, indices)

        return timed

    stack.enter_context(_patched(GradReductions, "launch", record))


def prewarm() -> None:
    from torch._inductor.utils import fresh_cache

    with fresh_cache():
        torch.compile(lambda x: (x * 2).sum())(torch.randn(8))


def train_alone(config: str, steps: int, warmup: int, bucket_size: int) -> dict:
    from torch._inductor.utils import fresh_cache

    rank, world = dist.get_rank(), dist.get_world_size()
    data, batch = data_and_batch(world)
    torch.manual_seed(0)
    model = Transformer(ModelArgs())
    out = {"times": [], "losses": [], "collectives": collections.Counter(), "bytes": 0, "compile": {}, "rooms": []}
    launches: list = []
    with fresh_cache(), contextlib.ExitStack() as patches:
        if config == "fxzero":
            _instrument_fxzero(patches, out, launches)
        cmodel, opt, state_bytes = build(config, model, bucket_size)
        with contextlib.ExitStack() as counting:
            for step in range(1, warmup + steps + 2):
                x, y = get_batch(data, step, batch, rank, world, torch.device("cpu"))
                dist.barrier()
                launches.clear()
                start = time.perf_counter()
                loss = cmodel(x, y)
                backward_start = time.perf_counter()
                if step == warmup + 1:  # a whole steady cycle: backward, step, zero_grad, next forward
                    counting.close()
                elif step == warmup:
                    counting.enter_context(_count_collectives(out))
                loss.backward()
                backward_end = time.perf_counter()
                opt.step()
                opt.zero_grad(set_to_none=True)
                elapsed = time.perf_counter() - start
                if step > warmup + 1:  # share of backward still ahead when each bucket launched
                    out["rooms"].append({i: (backward_end - at) / (backward_end - backward_start) for i, at in launches})
                if step == 1:
                    out["first"] = elapsed
                if step > warmup + 1:  # the profiled steps are not timed
                    out["times"].append(elapsed)
                total = loss.detach().clone()
                dist.all_reduce(total)
                out["losses"].append(total.item() / world)
    out["state_bytes"] = state_bytes()
    if config == "fxzero":
        names = {id(p): n for n, p in model.named_parameters()}
        out["buckets"] = [(b.index, len(b.params), b.grad_data.numel(), _span([names[id(p)] for p in b.params])) for b in opt.runtime.buckets]
    out["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return out


def _span(names: list[str]) -> str:
    """Which parts of the model a bucket's params come from, e.g. 'blocks 0,1,2,3 + norm'."""
    blocks = sorted({int(n.split(".")[1]) for n in names if n.startswith("layers.")})
    other = sorted({n.split(".")[0] for n in names if not n.startswith("layers.")})
    return " + ".join(([f"blocks {','.join(map(str, blocks))}"] if blocks else []) + other)




def data_and_batch(world: int) -> tuple[torch.Tensor, types.SimpleNamespace]:
    """The stdlib-bytes corpus and the batch shape every config (and the eager reference) uses."""
    data = torch.frombuffer(bytearray(load_bytes(None)), dtype=torch.uint8).long()
    return data, types.SimpleNamespace(seq=128, global_batch=PER_RANK * world)


def _check_compiled(runners: dict) -> None:
    for config, (_, opt, _) in runners.items():
        if config.startswith("fxzero"):
            compiled, n = sum(opt.runtime.ledger.compiled), len(opt.param_table.params)
            if compiled != n:
                raise RuntimeError(f"{config}: only {compiled} of {n} params are in its compiled graphs when stepping in turn")


def train_paired(configs: list[str], steps: int, warmup: int, bucket_size: int) -> dict:
    """Every config in this one process, stepping in turn: step ``k`` runs one training
    step of each config, in an order rotated by one every step, each timed after a
    barrier. A slow minute of a shared machine then slows every config alike, which
    separate runs minutes apart cannot promise. Nothing may run across a config's
    window into the next one's, so fxzero's step here also waits for its param
    all-gathers (``finish_param_sync``): its gather overlap (fxzero + overlap) is given up, which can
    only make fxzero slower. Returns each config's step times (s) and losses (mean over ranks)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    data, batch = data_and_batch(world)
    # Up to 8 models' graphs per code object here: at dynamo's default limit of 8 the
    # last configs' frames would silently run eagerly (seen: the block forward, whose
    # guards differ per model's hooks), timing something else than the alone runs.
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 4096
    runners = {}
    for config in configs:
        torch.manual_seed(0)
        model, opt, _ = build(config, Transformer(ModelArgs()), bucket_size)
        finish = opt.finish_param_sync if isinstance(opt, fxzero.DistributedOptimizer) else None
        runners[config] = (model, opt, finish)
    times: dict[str, list[float]] = {config: [] for config in configs}
    losses = torch.zeros(len(configs), warmup + steps + 1)
    # Dynamo's decisions to skip a frame are global to its code object: compiled first, an
    # FSDP2 model's graph breaks made fxzero's top-level forward run eagerly (seen: 4 of
    # 36 params through its eager hooks). So warm-up compiles in a fixed order, FSDP2
    # last, and fxzero's graphs are checked to hold all its params before timing.
    first = sorted(configs, key=lambda c: c.startswith("FSDP2"))
    for step in range(1, warmup + steps + 2):  # as many steps as train_alone, so losses compare
        x, y = get_batch(data, step, batch, rank, world, torch.device("cpu"))
        shift = step % len(configs)
        if step == warmup + 1:
            _check_compiled(runners)
        for config in (first if step <= warmup else configs[shift:] + configs[:shift]):
            model, opt, finish = runners[config]
            dist.barrier()
            start = time.perf_counter()
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if finish is not None:
                finish()
            if step > warmup + 1:
                times[config].append(time.perf_counter() - start)
            losses[configs.index(config), step - 1] = loss.item()
    dist.all_reduce(losses)
    return {"times": times, "losses": dict(zip(configs, (losses / world).tolist()))}
