"""Bad input at scale: each a clear error on every rank, in bounded time, naming what to fix.

* a process group that does not contain this rank (``dist.new_group([0, 1])`` on ranks 2 and 3);
* instances of hierarchical sharding that disagree on the model (the shard group agrees, the
  instances do not: gloo used to abort the process, or all-reduce shards of other sizes);
* expert params (MoE, ``Shard`` over an ``"ep"`` dim) given to the dense optimizer, and a param
  given to two optimizers, named by module path.

The world-4 checks share one run (gloo, 4 ranks); the messages are also checked at world 1.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fxzero
from fxzero.optim.layout import layout_agreement, mesh as mesh_module
from fxzero.testing import run_ranks

LR = 1e-2


def _refused(build: Any) -> str:
    try:
        build()
    except (ValueError, NotImplementedError, TypeError) as err:
        return f"{type(err).__name__}: {err}"
    return "not refused"


def _non_member() -> str:
    """Ranks 0 and 1 build and step on their group; ranks 2 and 3 were handed the sentinel."""
    group = dist.new_group([0, 1])
    model = nn.Linear(4, 4)
    message = _refused(lambda: fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, process_group=group, module=model))
    if dist.get_rank() < 2:
        opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, process_group=group, module=model)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        return "stepped"
    return message


def _instances_disagree(which: str) -> str:
    """``instance``: ranks 2 and 3 (instance 1) build another model; ``one``: rank 3 only."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    odd = rank >= 2 if which == "instance" else rank == 3
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3 if odd else 4))
    return _refused(lambda: fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, process_group=mesh, module=model))


def _experts() -> dict[str, str]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model.experts = nn.Parameter(distribute_tensor(torch.randn(4, 4, 8), mesh, [Replicate(), Shard(0)]))
    all_params = _refused(lambda: fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, module=model))
    dense = [p for n, p in model.named_parameters() if n != "experts"]
    first = fxzero.DistributedOptimizer(dense, torch.optim.AdamW, lr=LR, module=model)
    twice = _refused(lambda: fxzero.DistributedOptimizer([model[1].weight], torch.optim.AdamW, lr=LR, module=model))
    del first
    return dict(all_params=all_params, twice=twice)


def _at_world_4() -> dict[str, Any]:
    return dict(
        non_member=_non_member(),
        instance=_instances_disagree("instance"),
        one=_instances_disagree("one"),
        **_experts(),
    )


@pytest.mark.slow
def test_bad_groups_and_params_at_world_4_raise_on_every_rank_naming_the_fix() -> None:
    """World 4, one run: (10) ``new_group([0, 1])`` passed on ranks 2 and 3 is refused there,
    before any collective, naming ``new_subgroups``/``mesh['dp']``; ranks 0 and 1 build and step
    (nothing of theirs waits for 2 and 3). (11) 2 x 2 instances whose second instance (or only
    rank 3) builds another model: every rank raises the same error naming the first differing
    param and both ranks. (12) experts ``Shard(0)`` over ``"ep"`` given to a world-group
    optimizer: the message describes their placement per dim and names ``mesh['edp']``, not a
    ``mesh['dp']`` the mesh lacks; a param given to a second optimizer is named by module path."""
    runs = run_ranks(4, _at_world_4, timeout=180)
    assert [r["non_member"] for r in runs[:2]] == ["stepped", "stepped"], runs
    for rank in (2, 3):
        message = runs[rank]["non_member"]
        assert message.startswith("ValueError: fxzero: process_group is GroupMember.NON_GROUP_MEMBER"), message
        assert f"does not contain this rank (global rank {rank})" in message and "dist.new_subgroups" in message, message
    for case in ("instance", "one"):
        messages = {r[case] for r in runs}
        assert len(messages) == 1, messages
        (message,) = messages
        assert "ranks disagree on param 2 of the bucket layout: rank 0 (instance 0) has '1.weight' (shape [4, 4]" in message, message
        odd = "rank 2 (instance 1)" if case == "instance" else "rank 3 (instance 1)"
        assert f"{odd} has '1.weight' (shape [3, 4]" in message, message
    for rank, run in enumerate(runs):
        message = run["all_params"]
        assert "spans mesh dim 'ep'" in message and "param 'experts' is Shard(dim=0) over it" in message, message
        assert "Replicate() over 'edp' and Shard(dim=0) over 'ep'" in message and "process_group=mesh['edp']" in message, message
        assert "mesh['dp']" not in message, message
        assert "param '1.weight' (shape (4, 4)) is already managed by another" in run["twice"], run["twice"]


# ---- world 1: the messages -----------------------------------------------------------------------
def test_a_non_member_group_is_refused_naming_the_fix_at_world_1() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"NON_GROUP_MEMBER.*does not contain this rank.*dist\.new_subgroups.*mesh\['dp'\]"):
        fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=LR, process_group=dist.GroupMember.NON_GROUP_MEMBER)
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
        fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=LR, process_group=3)  # type: ignore[arg-type]


def _layout(shape: tuple[int, ...]) -> layout_agreement.Description:
    return ((("a.weight", (4, 4), "torch.float32", 0, False), ("b.weight", shape, "torch.float32", 0, False)), ("64",))


def test_a_disagreement_names_the_first_differing_param_and_both_ranks_with_their_instances() -> None:
    every = [("rank 0 (instance 0)", _layout((4, 4))), ("rank 1 (instance 0)", _layout((4, 4))), ("rank 2 (instance 1)", _layout((3, 4)))]
    message = layout_agreement._disagreement(every)
    assert message.startswith("fxzero: ranks disagree on param 1 of the bucket layout: rank 0 (instance 0) has 'b.weight' (shape [4, 4]"), message
    assert "rank 2 (instance 1) has 'b.weight' (shape [3, 4]" in message and "same params, in the same order" in message, message


def _fake_param(names: Any, sizes: tuple[int, ...], placements: tuple[Any, ...]) -> Any:
    mesh = types.SimpleNamespace(mesh_dim_names=names, ndim=len(sizes), size=lambda d: sizes[d])
    return types.SimpleNamespace(device_mesh=mesh, placements=placements)


def test_the_dp_dim_named_is_the_one_every_dtensor_param_is_replicated_over() -> None:
    """The fix names a dim the params' mesh has: the one every DTensor param on it is
    Replicate over (``edp`` for experts); a 1-D or unnamed mesh is named as such."""
    from torch.distributed.tensor import Replicate, Shard

    experts = _fake_param(("edp", "ep"), (2, 2), (Replicate(), Shard(0)))
    assert mesh_module._placed(experts) == "a DTensor on mesh dims ('edp', 'ep'), Replicate() over 'edp' and Shard(dim=0) over 'ep'"
    assert mesh_module._dp_fix(experts, [experts]) == "process_group=mesh['edp']"
    unnamed = _fake_param(None, (2, 2), (Replicate(), Shard(0)))
    assert mesh_module._dp_fix(unnamed, [unnamed]) == "process_group=mesh.get_group(0)"
    whole = _fake_param(None, (4,), (Replicate(),))
    assert mesh_module._dp_fix(whole, [whole]) == "process_group=<the params' 1-D DeviceMesh>"
    tp = _fake_param(("tp",), (2,), (Shard(0),))
    assert mesh_module._dp_fix(tp, [tp]).startswith("process_group=mesh['dp'] where mesh is the DeviceMesh that dims ('tp',)")


def test_a_param_in_two_optimizers_is_named_by_module_path() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    first = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=LR, module=model)
    with pytest.raises(ValueError, match=r"param '1\.weight' \(shape \(2, 2\)\) is already managed by another"):
        fxzero.DistributedOptimizer([model[1].weight], torch.optim.SGD, lr=LR, module=model)
    del first
