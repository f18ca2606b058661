"""The wrapped optimizer's update over runs of adjacent fragments: one tensor per run.

``torch.optim`` pays per tensor: a Python iteration of its single-tensor loop (the CPU
default) or a slot of a foreach list. The wrapped optimizer holds one tensor per
fragment, so a model of many small params pays that per param, every step, although
its fragments lie side by side in each bucket's fp32 main shard. For the classes whose
update of each element reads only that element's gradient and state
(:data:`~fxzero.optim.layout.validation.ELEMENTWISE_OPTIMIZERS`, the same property that lets
fxzero cut params into fragments at all), the update of a run of adjacent fragments
as one flat tensor gives every element the bits it gets fragment by fragment. DeepSpeed's
ZeRO optimizers step one flat fp32 partition the same way.

So a second instance of the wrapped class, the **twin**, holds one flat view of the main
shard per :class:`Run` (adjacent fragments of one param group, up to :data:`MAX_RUN_NUMEL`
elements; padding ends a run), its ``.grad`` the matching view of the grad shard. Its state is **homed** in the wrapped
optimizer's: each fragment's elementwise state (AdamW's moments) becomes a view of the
run's flat state tensor, and each per-param scalar (the step count) a 0-dim view of one
vector per run, refreshed from the twin's own scalar after each twin step. The wrapped
optimizer therefore always holds the whole state, per fragment, as before: state dicts,
checkpoints and ``opt.state`` read it unchanged, and a step that must hide some params
(they got no gradient) runs it, fragment by fragment, on the same memory.

The twin steps only while the homing provably holds, checked in C-level scans before
each step: the same state mapping, the same dict per fragment, the same tensors in it
(a ``load_state_dict``, or anything that replaced a state tensor, ends the homing; the
next step re-homes). Homing needs every fragment of a run to hold the same keys, its
scalars equal: after a step that hid some params of a run their step counts differ,
and the wrapped optimizer keeps stepping fragment by fragment, exactly, until a load
replaces the state. Fused kernels, differentiable steps and other devices than the CPU
(where the bitwise equality is tested) keep the per-fragment update too.

:func:`plan_runs` is pure (fragment places in, runs out), tested without tensors.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any, Callable, Optional, Sequence

import torch

from ... import _torch_compat as compat
from .bucketed_update import BucketParts, ByBucket, step_each_bucket
from ..layout.shards import FragmentTensor
from ..state.state_dict import copy_hyperparameters, hyperparameters
from ..layout.validation import ELEMENTWISE_OPTIMIZERS

__all__ = ["MAX_RUN_NUMEL", "ByBucket", "FlatUpdate", "Place", "Run", "flat_update_applies", "place_of", "plan_runs"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Run:
    """Fragments ``fragments`` (indices, in memory order) lying side by side, their params in
    one storage from element ``start`` to ``stop`` and their grads likewise from ``grad_start``."""

    fragments: tuple[int, ...]
    group: int
    bucket: int
    start: int
    stop: int
    grad_start: int


@dataclasses.dataclass(frozen=True)
class Place:
    """Where one fragment lies: its param and grad storages (their addresses), param group,
    bucket, offsets in each storage and length."""

    storage: int
    grad_storage: int
    group: int
    bucket: int
    offset: int
    grad_offset: int
    numel: int


MAX_RUN_NUMEL = 1 << 20
"""Elements a run grows to at most (4 MiB of fp32): the update's temporaries are the size of
the tensor it steps, so a run is kept within the largest param of a real model; a fragment
longer than this is a run of its own, as before."""


def plan_runs(places: Sequence[Place], max_numel: int = MAX_RUN_NUMEL) -> tuple[Run, ...]:
    """Runs of fragments adjacent in both storages and of one group and bucket, each at most
    ``max_numel`` long unless one fragment is: a gap (padding), another storage, group or
    bucket (the update may step one bucket at a time), or the length ends a run."""
    runs: list[Run] = []
    keys: list[tuple[int, int, int, int]] = []
    order = sorted(range(len(places)), key=lambda i: (places[i].storage, places[i].offset))
    for i in order:
        p = places[i]
        key = (p.storage, p.grad_storage, p.group, p.bucket)
        last = runs[-1] if runs else None
        adjacent = last is not None and keys[-1] == key and last.stop == p.offset and last.grad_start + (last.stop - last.start) == p.grad_offset
        if adjacent and last.stop + p.numel - last.start <= max_numel:  # type: ignore[union-attr]
            runs[-1] = dataclasses.replace(last, fragments=last.fragments + (i,), stop=p.offset + p.numel)
        else:
            runs.append(Run((i,), p.group, p.bucket, p.offset, p.offset + p.numel, p.grad_offset))
            keys.append(key)
    return tuple(runs)


def flat_update_applies(optimizer_class: type, fragments: Sequence[FragmentTensor]) -> bool:
    """Whether runs can step as one tensor with the same bits: an elementwise class (exactly,
    not a subclass: its step may differ) over 1-D fp32 fragments on the CPU."""
    if optimizer_class not in ELEMENTWISE_OPTIMIZERS or not fragments:
        return False
    return all(f.param.device.type == "cpu" and f.param.dtype == torch.float32 and f.param.dim() == 1 for f in fragments)


def place_of(frag: FragmentTensor, group: int, bucket: int) -> Place:
    """Where ``frag`` (of param group ``group``, in bucket ``bucket``) lies."""
    param, grad = frag.param, frag.grad
    return Place(_storage(param), _storage(grad), group, bucket, param.storage_offset(), grad.storage_offset(), param.numel())


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class FlatUpdate:
    """Steps the wrapped optimizer ``local`` through its twin where that is exact."""

    def __init__(
        self,
        local: torch.optim.Optimizer,
        fragments: Sequence[FragmentTensor],
        groups: Sequence[int],
        buckets: Sequence[int],
        kwargs: dict[str, Any],
        *,
        bucket_count: int,
    ) -> None:
        """``groups[i]``, ``buckets[i]``: the param group and bucket of ``fragments[i]`` (of
        ``bucket_count``: a rank may own nothing in some); ``kwargs``: what ``local`` was built with."""
        self.local, self.fragments = local, tuple(fragments)
        count = bucket_count
        bucket_of = dict(zip(map(id, (f.param for f in self.fragments)), buckets))
        self._local_parts = BucketParts([g["params"] for g in local.param_groups], lambda t: bucket_of[id(t)], count)
        self.twin: Optional[torch.optim.Optimizer] = None
        """The wrapped class over one flat tensor per run; ``None`` where it does not apply."""
        self.flat_steps = 0
        """Updates made through the twin (the others went fragment by fragment)."""
        self._homed = False
        self._blocked: Any = None  # the state mapping homing failed on: not retried until replaced
        self._params = [f.param for f in self.fragments]
        if not flat_update_applies(type(local), self.fragments):
            return
        self.runs = plan_runs([place_of(f, g, b) for f, g, b in zip(self.fragments, groups, buckets)])
        twin_groups = [hyperparameters(g) | {"params": []} for g in local.param_groups]
        self._flats = [self._flat(run) for run in self.runs]
        for run, flat in zip(self.runs, self._flats):
            twin_groups[run.group]["params"].append(flat)
        used = [g for g, t in enumerate(twin_groups) if t["params"]]
        self.twin = type(local)([twin_groups[g] for g in used], **kwargs)
        self._twin_groups = [(g, self.twin.param_groups[k]) for k, g in enumerate(used)]
        """(index of the wrapped optimizer's group, the twin's group): by index, since the wrapped
        optimizer's ``load_state_dict`` replaces its group dicts."""
        self._twin_step = compat.unhooked_step(self.twin)
        run_bucket = {id(flat): run.bucket for run, flat in zip(self.runs, self._flats)}
        self._twin_parts = BucketParts([g["params"] for g in self.twin.param_groups], lambda t: run_bucket[id(t)], count)

    def _flat(self, run: Run) -> torch.Tensor:
        first = self.fragments[run.fragments[0]]
        flat = first.param.as_strided((run.stop - run.start,), (1,), run.start)
        flat.grad = first.grad.as_strided((run.stop - run.start,), (1,), run.grad_start)
        return flat

    # ---- the step ---------------------------------------------------------------
    def step(self, local_step: Callable[[], Any], by_bucket: Optional[ByBucket] = None) -> None:
        """Update every fragment (each got a gradient): through the twin while homed, else
        ``local_step()``, fragment by fragment; one bucket at a time with ``by_bucket``."""
        if self._ready():
            self._sync_hyperparameters()
            self._run(self.twin.param_groups, self._twin_parts, self._twin_step, by_bucket)  # type: ignore[union-attr]
            self._after_twin_step()
            self.flat_steps += 1
        else:
            self._run(self.local.param_groups, self._local_parts, local_step, by_bucket)

    def step_apart(self, local_step: Callable[[], Any], by_bucket: Optional[ByBucket] = None) -> None:
        """A step that hides some fragments: only the wrapped optimizer can skip them, and
        their step counts then fall behind their runs' (homing is tried again after)."""
        self._homed = False
        self._run(self.local.param_groups, self._local_parts, local_step, by_bucket)

    @staticmethod
    def _run(groups: list[dict[str, Any]], parts: BucketParts, step: Callable[[], Any], by_bucket: Optional[ByBucket]) -> None:
        if by_bucket is None:
            step()
        else:
            step_each_bucket(groups, parts, by_bucket.order, step, by_bucket.after)

    def _ready(self) -> bool:
        if self.twin is None or any(g.get("fused") or g.get("differentiable") for g in self.local.param_groups):
            return False  # a fused or differentiable step's bits may change when flat (fused ones do)
        if self._homed and self._still_homed():
            return True
        self._homed = False
        state = self.local.state
        if state is self._blocked or not state:  # nothing to home before the first update
            return False
        self._homed = self._home()
        if not self._homed:
            self._blocked = state
            log.info("the wrapped optimizer's state differs within a run of fragments: it steps fragment by fragment")
        return self._homed

    def _sync_hyperparameters(self) -> None:
        """The twin's groups take the wrapped optimizer's values (an LR scheduler's, too)."""
        groups = self.local.param_groups
        for index, twin in self._twin_groups:
            copy_hyperparameters(groups[index], twin)

    # ---- homing -----------------------------------------------------------------
    def _home(self) -> bool:
        """Make each run's fragment states views of one tensor per key (see the module
        docstring); False, changing nothing, when some run's states differ."""
        state = self.local.state
        plans = []
        for run in self.runs:
            plan = _home_plan([state.get(self.fragments[i].param) for i in run.fragments], [self.fragments[i].param.numel() for i in run.fragments])
            if plan is None:
                return False
            plans.append(plan)
        entries: list[tuple[dict, str, torch.Tensor]] = []
        self._scalars: list[tuple[torch.Tensor, torch.Tensor]] = []
        for run, flat, plan in zip(self.runs, self._flats, plans):
            states = [state[self.fragments[i].param] for i in run.fragments]
            self.twin.state[flat] = _apply_plan(plan, states, entries, self._scalars)
        self._state = state
        self._dicts = list(map(state.get, self._params))
        self._lens = list(map(len, self._dicts))  # homed: every fragment holds state
        self._entry_dicts = [e[0] for e in entries]
        self._entry_keys = [e[1] for e in entries]
        self._entry_values = [e[2] for e in entries]
        self._twin_states = [self.twin.state[flat] for flat in self._flats]
        self._key_counts = list(map(len, self._twin_states))
        self._twin_entries = [(t, key, value) for t in self._twin_states for key, value in t.items()]
        return True

    def _still_homed(self) -> bool:
        """The homing holds: the same state mapping, dict per fragment, keys and tensors
        (C-level scans), and every fragment's scalars still the twin's (one written in place,
        such as a step count edited by hand, ends the homing: its run then differs)."""
        state = self.local.state
        return (
            state is self._state
            and all(map(operator.is_, map(state.get, self._params), self._dicts))
            and list(map(len, self._dicts)) == self._lens
            and all(map(operator.is_, map(dict.get, self._entry_dicts, self._entry_keys), self._entry_values))
            and all(bool(vector.eq(scalar).all()) for vector, scalar in self._scalars)
        )

    def _after_twin_step(self) -> None:
        """The fragments' scalars take the twin's; a state tensor the class replaced rather
        than updated in place is copied into the homed memory, so the fragments see it."""
        for state, key, homed in self._twin_entries:
            value = state[key]
            if value is not homed:
                if not (isinstance(value, torch.Tensor) and value.shape == homed.shape):
                    raise RuntimeError(f"fxzero: {type(self.twin).__name__} replaced its state {key!r} by a value of another kind")
                homed.copy_(value)
                state[key] = homed
        for vector, scalar in self._scalars:
            vector.copy_(scalar.expand_as(vector))
        if list(map(len, self._twin_states)) != self._key_counts:  # no elementwise class adds state after its first step
            raise RuntimeError(f"fxzero: {type(self.twin).__name__} added state keys after its first step; the flat update cannot give them to the fragments")


def _home_plan(states: Sequence[Optional[dict]], numels: Sequence[int]) -> Optional[dict[str, tuple[str, list[torch.Tensor]]]]:
    """How each key of one run's fragment states (of fragments of ``numels`` elements) is
    homed, as ``(kind, values)``; ``None`` when one holds none (the twin would create it where
    the wrapped optimizer does not see it) or they differ in keys, kinds or scalar values."""
    if any(not s for s in states) or len({frozenset(s) for s in states}) != 1:  # type: ignore[arg-type]
        return None
    plan: dict[str, tuple[str, list[torch.Tensor]]] = {}
    for key in states[0]:  # type: ignore[union-attr]
        values = [s[key] for s in states]  # type: ignore[index]
        kind = _kind(values, numels)
        if kind is None:
            return None
        plan[key] = (kind, values)
    return plan


def _kind(values: Sequence[Any], numels: Sequence[int]) -> Optional[str]:
    """``"elementwise"`` (1-D tensors of each fragment's length: its moments), ``"scalar"``
    (equal 0-dim tensors: a step count), or None (anything else: stepped fragment by fragment)."""
    first = values[0]
    if not all(isinstance(v, torch.Tensor) and v.dtype == first.dtype and v.device == first.device for v in values):
        return None
    if all(v.dim() == 0 for v in values):
        return "scalar" if all(torch.equal(v, first) for v in values) else None
    return "elementwise" if all(v.dim() == 1 and v.numel() == n for v, n in zip(values, numels)) else None


def _apply_plan(plan: dict[str, tuple[str, list[torch.Tensor]]], states: Sequence[dict], entries: list, scalars: list) -> dict[str, Any]:
    """Home one run's fragment ``states`` as ``plan`` says; returns the twin's state of the run."""
    twin: dict[str, Any] = {}
    for key, (kind, values) in plan.items():
        if kind == "scalar":
            vector = torch.stack(values)
            twin[key] = values[0].clone()
            scalars.append((vector, twin[key]))
            views = list(vector.unbind())
        else:
            whole = torch.cat(values)
            twin[key] = whole
            views = list(whole.split([v.numel() for v in values]))
        values.clear()  # the replaced tensors go as their fragments take the views: one key's worth at a time
        for state, view in zip(states, views):
            state[key] = view
            entries.append((state, key, view))
    return twin
