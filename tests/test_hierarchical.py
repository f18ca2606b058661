"""Hierarchical (multi-instance) sharding: ``process_group=`` a 2-D ``("replicate", "shard")``
mesh. State is sharded inside an instance and replicated across instances; the reductions run
inside the instance, then this rank's shard is all-reduced over the instances; gathers never
leave the instance. At world 4 (2 instances x 2 shards, gloo) against flat world 4 and against
one process on the global batch, eager and compiled."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import fxzero
from fxzero.testing import run_ranks
from models import GPT, GPTArgs

LR, CLIP, STEPS, GLOBAL = 1e-2, 0.5, 4, 8
ARGS = GPTArgs()


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, ARGS.vocab, (GLOBAL, ARGS.seq + 1), generator=torch.Generator().manual_seed(7 + step))


def _loss(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _group(kind: str) -> Any:
    """``hier``: a ("replicate", "shard") mesh of 2 x world/2; ``flat``: the world."""
    if kind == "flat":
        return None
    return init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))


def _train(kind: str, inner: Optional[str] = None, ckpt: Optional[str] = None, resume: bool = False, by_bucket: bool = True) -> dict[str, Any]:
    """fxzero (``kind``) on this rank's slice of each global batch, and one-process AdamW on
    the whole batch, side by side; with ``ckpt``: save after step 2 (or, ``resume``: load it
    and run steps 3..STEPS only)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = GPT(ARGS)
    model = copy.deepcopy(ref)
    config = fxzero.Config(clip_grad=CLIP, bucket_size=3000, overlap_param_gather_with_optimizer_step=by_bucket)
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, process_group=_group(kind), module=model, config=config)
    run = model if inner is None else torch.compile(model, backend="fxzero", options={"inner_compiler": inner})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    first, generators = 1, None
    if resume:
        info = fxzero.load_checkpoint(fxzero.latest_checkpoint(ckpt), model, opt)
        first, generators = info["step"] + 1, info["rng"]
    steps = []
    for step in range(1, STEPS + 1):
        tokens = _tokens(step)
        if step >= first:
            loss = _loss(run, tokens.chunk(world)[rank])
            loss.backward()
            result = opt.step()
            dist.all_reduce(loss := loss.detach().clone())
            steps.append(dict(loss=float(loss) / world, grad_norm=result.grad_norm, skipped=result.skipped))
            if ckpt is not None and not resume and step == 2:
                fxzero.save_checkpoint(ckpt, model, opt, step=2)
        ref_loss = _loss(ref, tokens)
        ref_loss.backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP))
        ref_opt.step()
        ref_opt.zero_grad()
        if step >= first:
            steps[-1].update(ref_loss=float(ref_loss), ref_norm=ref_norm)
    refs = dict(ref.named_parameters())
    diff = max(float((p.detach() - refs[n]).abs().max()) for n, p in model.named_parameters())
    return dict(steps=steps, diff=diff, state=opt.state_bytes, collectives=opt.collectives_per_step,
                params=[p.detach().clone() for p in model.parameters()], generators=generators)  # fmt: skip


def _assert_parity(runs: list[dict[str, Any]]) -> None:
    for rank, run in enumerate(runs):
        for step in run["steps"]:
            assert not step["skipped"] and abs(step["loss"] - step["ref_loss"]) <= 1e-5, (rank, step)
            assert abs(step["grad_norm"] - step["ref_norm"]) <= 1e-6 * step["ref_norm"], (rank, step)
        assert run["diff"] <= 1e-4, (rank, run["diff"])
    assert max(s["ref_norm"] for s in runs[0]["steps"]) > CLIP  # clipping was active


@pytest.mark.slow
@pytest.mark.parametrize("inner", [None, "eager"])
def test_two_instances_of_two_train_like_flat_world_4_and_one_process(inner: Optional[str]) -> None:
    """Eager and compiled: 2 x 2 against one process (loss 1e-5, params 1e-4, norm 1e-6
    relative) and against flat world 4 (params 1e-5); every rank holds the optimizer state of a
    2-rank shard (twice flat world 4's); one all-reduce per bucket over the instances is added,
    and the instances' replicas end bitwise equal."""
    hier = run_ranks(4, _train, "hier", inner, timeout=300)
    flat = run_ranks(4, _train, "flat", inner, timeout=300)
    if inner is None:  # the update bucket by bucket (the default) is bitwise the update of every shard first
        whole = run_ranks(4, _train, "hier", None, None, False, False, timeout=300)
        assert all(a["steps"] == b["steps"] and all(map(torch.equal, a["params"], b["params"])) for a, b in zip(hier, whole))
    _assert_parity(hier)
    _assert_parity(flat)
    for rank in range(4):
        for a, b in zip(hier[rank]["params"], flat[rank]["params"]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        assert all(torch.equal(a, b) for a, b in zip(hier[rank]["params"], hier[(rank + 2) % 4]["params"]))
    assert 1.9 < hier[0]["state"] / flat[0]["state"] < 2.1, (hier[0]["state"], flat[0]["state"])
    buckets = hier[0]["collectives"]["allreduce"] - 2  # the others: the norm's all-reduce and the gradient flags' over the instances
    assert buckets >= 1 and flat[0]["collectives"]["allreduce"] == 1, (hier[0]["collectives"], flat[0]["collectives"])


def test_a_2d_mesh_with_other_dim_names_is_refused_naming_both_fixes() -> None:
    from fxzero.optim.communication.comm import _mesh_groups

    class Mesh(torch.distributed.device_mesh.DeviceMesh):  # type: ignore[misc]
        def __init__(self) -> None:  # no process group needed to be refused
            pass

        ndim = 2
        mesh_dim_names = ("dp", "tp")

    with pytest.raises(ValueError, match=r"process_group=mesh\['dp'\].*\('replicate', 'shard'\)"):
        _mesh_groups(Mesh())


def _checkpoint_round(kind: str, ckpt: str, resume: bool) -> dict[str, Any]:
    return _train(kind, None, ckpt, resume)


@pytest.mark.slow
def test_a_hierarchical_checkpoint_resumes_flat_at_world_4_and_2(tmp_path: Path) -> None:
    """Saved at 2 x 2 after step 2 (instance 0 writes, the other instance waits for it): resumed
    at flat world 4, at flat world 2 and at 2 x 2 (each instance loads it over its own shard
    group), steps 3..4 match the uninterrupted 2 x 2 run (loss 1e-5) and one process. Every rank's
    generator states are saved (instance 0's ranks write their counterparts' too) and restored at
    2 x 2 only."""
    ckpt = str(tmp_path)
    saved = run_ranks(4, _checkpoint_round, "hier", ckpt, False, timeout=300)
    assert sorted(p.name for p in fxzero.latest_checkpoint(ckpt).glob("rng_state_*")) == [f"rng_state_{r}.pt" for r in range(4)]
    flat4 = run_ranks(4, _checkpoint_round, "flat", ckpt, True, timeout=300)
    flat2 = run_ranks(2, _checkpoint_round, "flat", ckpt, True, timeout=300)
    hier = run_ranks(4, _checkpoint_round, "hier", ckpt, True, timeout=300)
    want = [s["loss"] for s in saved[0]["steps"][2:]]
    for runs in (flat4, flat2, hier):
        got = [s["loss"] for s in runs[0]["steps"]]
        assert len(got) == 2 and max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)
        _assert_parity(runs)
    saved_at = "saved at world size 4 (data-parallel size 2 in 2 instances)"
    assert {r["generators"] for r in hier} == {"restored"}
    assert {r["generators"] for r in flat4} == {f"not restored: {saved_at}, loaded at world size 4 (data-parallel size 4)"}
    assert {r["generators"] for r in flat2} == {f"not restored: {saved_at}, loaded at world size 2 (data-parallel size 2)"}


def _explain_hier() -> str:
    torch.manual_seed(0)
    model = GPT(ARGS)
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, process_group=_group("hier"), module=model,
                                      config=fxzero.Config(bucket_size=3000))  # fmt: skip
    return " ".join(fxzero.explain(model, _tokens(0)[:2, :-1], optimizer=opt, inner_compiler="eager").split())


@pytest.mark.slow
def test_explain_names_the_instance_group_and_the_shard_group() -> None:
    lines = run_ranks(4, _explain_hier, timeout=300)
    assert "data-parallel group: ranks [0, 1]; instances: 2, this rank's shard all-reduced over ranks [0, 2]" in lines[0], lines[0]
    assert "data-parallel group: ranks [2, 3]; instances: 2, this rank's shard all-reduced over ranks [1, 3]" in lines[3], lines[3]


def _refused_with_dtensor() -> str:
    from torch.distributed.tensor import Replicate, distribute_tensor

    param = torch.nn.Parameter(distribute_tensor(torch.randn(4, 4), init_device_mesh("cpu", (4,)), [Replicate()]))
    try:
        fxzero.DistributedOptimizer([param], torch.optim.AdamW, lr=LR, process_group=_group("hier"))
    except NotImplementedError as err:
        return str(err)
    return "not refused"


@pytest.mark.slow
def test_dtensor_params_with_hierarchical_sharding_are_refused_naming_the_fix() -> None:
    message = run_ranks(4, _refused_with_dtensor, timeout=120)[0]
    assert "is a DTensor, and hierarchical sharding" in message and "process_group=<the params' 1-D DeviceMesh>" in message, message


def _one_instance_only(zeroed: bool) -> list[torch.Tensor]:
    """A head that gets gradients on instance 1's ranks only, then on none: every instance must step
    it (presence is counted over the instances), and what the reduction left in each rank's shard
    must not be counted again (``fxzero.optim.gradients.stale_grads``)."""
    from test_stale_grads import CLIP as HEAD_CLIP, Heads

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Heads()
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=0.1, module=model, process_group=_group("hier"),
                                      config=fxzero.Config(bucket_size=100, clip_grad=HEAD_CLIP))  # fmt: skip
    if zeroed:  # the buffers zeroed after every step: nothing is ever stale
        buckets = opt.runtime.buckets
        opt.runtime.stale.consumed = lambda present: [b.grad_data.zero_() for b in buckets]
    seen = []
    for step, uses in enumerate([("a", "b"), ("c",) if rank >= 2 else (), (), ("a",), ()]):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x, uses).square().mean().backward()
        assert not opt.step().skipped
        opt.zero_grad()
        seen.append(torch.cat([p.detach().flatten().clone() for p in model.parameters()]))
    return seen


def _both_ways() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return _one_instance_only(False), _one_instance_only(True)


@pytest.mark.slow
def test_a_param_with_gradients_in_one_instance_only_is_stepped_in_every_instance() -> None:
    results = run_ranks(4, _both_ways, timeout=300)
    for step in range(5):
        stale, zeroed = [r[0][step] for r in results], [r[1][step] for r in results]
        assert all(torch.equal(stale[0], s) for s in stale), step  # the instances' copies stay alike
        assert all(torch.equal(s, z) for s, z in zip(stale, zeroed)), step
