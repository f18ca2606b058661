"""fxzero's own Adam/AdamW over runs of the shard, for narrow state and param remainders.

``torch.optim.AdamW`` keeps fp32 moments per param and needs an fp32 tensor to update. Two
options of :class:`~fxzero.Config` need something else, so fxzero steps Adam/AdamW itself
when one is set (any other class with one is refused at construction, naming the option):

* ``optimizer_state_dtype`` (or ``exp_avg_dtype`` / ``exp_avg_sq_dtype``) ``"bf16"`` or ``"fp8"``: a moment is kept narrower
  (:mod:`~fxzero.optim.update.moment_store`); the update computes in fp32;
* ``param_remainders``: bf16 params keep no fp32 master; each run keeps an int16 remainder
  that rebuilds it exactly with the param (:mod:`~fxzero.optim.params.bf16_rounding`).

**Runs.** Adjacent fragments of one param group and bucket are one flat run
(:func:`~fxzero.optim.update.flat_update.plan_runs`), and each run is one tensor per moment:
the update is a handful of torch ops per run, not per param. Step counts are per fragment,
as torch keeps them per param: a step that hides some fragments (they got no gradient) steps
the rest of their run as stretches (adjacent fragments with a gradient and the same count, one
tensor each: compiled too, where a stretch cuts no 8-bit block), and their counts then differ.
Only the runs holding a hidden fragment step so, not the rest of its param group
(``tests/test_run_stretches.py``).

**The same bits as torch.** Each update is ``torch.optim.adam._single_tensor_adam``'s
sequence of ops on fp32 values (lerp, mul/addcmul, Python-float bias corrections, addcdiv),
so with fp32 state this class trains bitwise like ``torch.optim.AdamW(foreach=False)``
(tested); only the rounding of what is kept differs in the other modes.

**Its state, seen from outside**, is per fragment and plain (``step``, ``exp_avg``,
``exp_avg_sq`` shaped like the fragment: bf16 views, or the 8-bit values decoded exactly),
so ``opt.state``, state dicts and checkpoints read and load it as torch.optim's, and a
checkpoint moves between modes (the narrower mode rounds what it loads).
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Optional

import torch

from ...inductor_function import Compiling
from ..layout.shards import FragmentTensor
from ..params import bf16_rounding
from ..state.state_dict import REMAINDER_KEY
from .flat_update import Place, Run, plan_runs
from ..params.rounding_kernels import RoundingKernels
from .fused_run import FusedRunUpdate
from .moment_store import MomentStore, make_stores
from .torch_fused import TorchFusedRun

__all__ = ["ADAM_CLASSES", "ShardAdamW", "UNSUPPORTED_FLAGS"]

ADAM_CLASSES = (torch.optim.Adam, torch.optim.AdamW)
"""The classes (exactly: a subclass may change the update) fxzero's own update stands in for."""

UNSUPPORTED_FLAGS = ("amsgrad", "capturable", "differentiable", "fused")
"""Adam options fxzero's own update does not implement: refused, naming the flag (``fused`` is
implemented with remainders and fp32 moments: :mod:`.torch_fused`)."""
_GRAD = operator.attrgetter("grad")
_NO_RUNS: frozenset[int] = frozenset()


@dataclasses.dataclass(eq=False)
class _RunState:
    run: Run
    param: torch.Tensor
    """The run's params: an fp32 view of the main shard, or a bf16 view of the param shard (remainders)."""
    grad: torch.Tensor
    exp_avg: MomentStore
    exp_avg_sq: MomentStore
    remainder: Optional[torch.Tensor]
    steps: list[int]
    """One count per fragment of the run."""
    spans: list[slice]
    """Where each fragment of the run lies in it."""
    scratch: Optional[torch.Tensor] = None
    """With a remainder: where the step rebuilds the run's fp32 master (a view of one tensor every run shares)."""
    torch_fused: Optional[TorchFusedRun] = None
    """With fp32 moments: the run's fragments under torch's fused kernel, for a group with ``fused=True``."""

    def master(self, kernels: RoundingKernels) -> torch.Tensor:
        return self.param if self.remainder is None else kernels.join(self.param, self.remainder, self.scratch)

    def keep_master(self, master: torch.Tensor, kernels: RoundingKernels) -> None:
        """Split the updated ``master`` (the run's scratch: not read again) into param and remainder."""
        if self.remainder is not None:
            kernels.split_consuming(master, self.param, self.remainder)


class ShardAdamW(torch.optim.Optimizer):
    """Adam (``decoupled=False``) or AdamW over this rank's fragments, stepped run by run."""

    def __init__(
        self, groups: list[dict[str, Any]], fragments: Sequence[FragmentTensor], places: Sequence[Place], *,
        state_dtypes: tuple[str, str], remainders: bool, decoupled: bool, compiled: Optional[bool] = False,
    ) -> None:  # fmt: skip
        super().__init__(groups, {})
        self.fragments, self.decoupled, self.state_dtypes = tuple(fragments), decoupled, state_dtypes
        wanted = compiled is not False and state_dtypes != ("fp32", "fp32")
        self.fused = FusedRunUpdate(Compiling(compiled, "the narrow moments' Adam update")) if wanted else None
        """The Inductor-generated run update (``Config.compiled_update``: ``True`` or ``None``), for narrow
        moments only (:mod:`~fxzero.optim.update.fused_run` says why); where it cannot be compiled under
        ``None``, the eager update, over the same stores."""
        self._runs = [self._run_state(run, remainders) for run in plan_runs(places)]
        rebuilt = [rs for rs in self._runs if rs.remainder is not None]
        self._scratch = torch.empty(max((rs.param.numel() for rs in rebuilt), default=0), dtype=torch.float32,
                                    device=rebuilt[0].param.device if rebuilt else None)  # fmt: skip
        """Where the step rebuilds a run's fp32 master, one run at a time: the longest run's size (at most
        :data:`~fxzero.optim.update.flat_update.MAX_RUN_NUMEL` elements), so the step allocates nothing."""
        for rs in rebuilt:
            rs.scratch = self._scratch[: rs.param.numel()]
        self._allowed = ("fused",) if state_dtypes == ("fp32", "fp32") else ()
        """Flags of :data:`UNSUPPORTED_FLAGS` this update has after all: ``fused`` over fp32 moments (:mod:`.torch_fused`)."""
        if self._allowed:  # torch's fused kernel takes fp32 moments only
            for rs in self._runs:
                master = rs.param if rs.scratch is None else rs.scratch
                rs.torch_fused = TorchFusedRun(master, rs.grad, rs.exp_avg.load(), rs.exp_avg_sq.load(), rs.spans)
        self.remainders = any(rs.remainder is not None for rs in self._runs)
        """Whether some masters are kept as remainders (:class:`~fxzero.optim.state.fragment_store.FragmentStore`)."""
        self._where = {id(self.fragments[i].param): (r, k) for r, rs in enumerate(self._runs) for k, i in enumerate(rs.run.fragments)}
        self._cache: dict[int, tuple[list[torch.Tensor], int, list[int]]] = {}
        self.kernels = RoundingKernels(compiled)
        """How masters are split into params and remainders and joined again (compiled with the update)."""
        self.state = _FragmentStates(self)  # type: ignore[assignment]

    def _run_state(self, run: Run, remainders: bool) -> _RunState:
        first = self.fragments[run.fragments[0]]
        n = run.stop - run.start
        param = first.param.as_strided((n,), (1,), run.start)
        grad = first.grad.as_strided((n,), (1,), run.grad_start)
        remainder = torch.zeros(n, dtype=torch.int16, device=param.device) if remainders and param.dtype == torch.bfloat16 else None
        spans = []
        for i in run.fragments:
            lo = self.fragments[i].param.storage_offset() - run.start
            spans.append(slice(lo, lo + self.fragments[i].param.numel()))
        exp_avg, exp_avg_sq = make_stores(self.state_dtypes, n, param.device, paired=self.fused is not None)
        return _RunState(run, param, grad, exp_avg, exp_avg_sq, remainder, [0] * len(run.fragments), spans)

    # ---- the step -------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None if closure is None else closure()
        for group in self.param_groups:
            params = group["params"]
            if not params:
                continue
            hyper = _hyper(group, self.decoupled, allowed=self._allowed)
            hidden = self._hidden_runs(params)
            step_run = self._step_run_fused if group.get("fused") else self._step_run
            for r in self._runs_of(params):
                step_run(self._runs[r], hyper, r not in hidden)
        return loss

    def _hidden_runs(self, params: list[torch.Tensor]) -> frozenset[int]:
        """The runs holding a param of ``params`` without a gradient this step (one C-level scan of identity
        tests when every param has one: ``None in grads`` would call ``Tensor.__eq__`` on each, 12 us a
        param): the others step whole, so a frozen layer or an unpicked expert holds back only its own run."""
        grads = list(map(_GRAD, params))
        if not any(map(operator.is_, grads, itertools.repeat(None))):
            return _NO_RUNS
        return frozenset(self._where[id(p)][0] for p, g in zip(params, grads) if g is None)

    def _runs_of(self, params: list[torch.Tensor]) -> list[int]:
        """The runs ``params`` covers, cached by the list itself: it is this optimizer's own group list
        or a bucket's part of it (:class:`~fxzero.optim.update.bucketed_update.BucketParts`), each made
        once and never changed (the user's groups are checked by ``check_param_groups_kept``); the
        cache holds the list, so its id is not reused while cached."""
        cached = self._cache.get(id(params))
        if cached is None or cached[0] is not params or cached[1] != len(params):
            runs = list(dict.fromkeys(self._where[id(p)][0] for p in params))
            cached = self._cache[id(params)] = (params, len(params), runs)
        return cached[2]

    def _step_run(self, rs: _RunState, hyper: tuple, whole: bool) -> None:
        """Update run ``rs``: as one tensor when every fragment steps and their counts agree (the
        common case), else stretch by stretch (:meth:`_stretches`: a hidden fragment keeps its values
        and count), compiled where the stores can be cut there (:meth:`FusedRunUpdate.takes`)."""
        steps = rs.steps
        master = rs.master(self.kernels)
        if whole and steps.count(steps[0]) == len(steps):
            if self.fused is None or not self.fused(master, rs.grad, rs.exp_avg, rs.exp_avg_sq, steps[0] + 1, hyper):
                _step_eagerly(rs, master, hyper, step=steps[0] + 1)
            rs.steps = [steps[0] + 1] * len(steps)
        else:
            self._step_stretches(rs, master, hyper)
        rs.keep_master(master, self.kernels)

    def _stretches(self, rs: _RunState) -> list[tuple[int, int, int]]:
        """``(start, stop, step)``: the run's stretches of adjacent fragments that have a gradient and
        the same count, each stepped as one tensor (the same bits as fragment by fragment: the update
        is elementwise), and the count each steps to."""
        stretches: list[tuple[int, int, int]] = []
        for k, index in enumerate(rs.run.fragments):
            if self.fragments[index].param.grad is None:
                continue
            at, step = rs.spans[k], rs.steps[k] + 1
            if stretches and stretches[-1][1] == at.start and stretches[-1][2] == step:
                stretches[-1] = (stretches[-1][0], at.stop, step)
            else:
                stretches.append((at.start, at.stop, step))
        return stretches

    def _step_stretches(self, rs: _RunState, master: torch.Tensor, hyper: tuple) -> None:
        """Step the stretches of run ``rs``: compiled when every one can step alone (the stores are cut at
        its ends, no 8-bit block is shared with a hidden fragment), else eagerly over the run's loaded moments."""
        stretches = self._stretches(rs)
        if not stretches:
            return
        if self.fused is not None and all(self.fused.takes(rs.exp_avg, rs.exp_avg_sq, lo, hi) for lo, hi, _ in stretches):
            stretches = self._fused_stretches(rs, master, hyper, stretches)
        if stretches:
            _step_eagerly(rs, master, hyper, stretches)
        for k, index in enumerate(rs.run.fragments):
            if self.fragments[index].param.grad is not None:
                rs.steps[k] += 1

    def _fused_stretches(self, rs: _RunState, master: torch.Tensor, hyper: tuple, stretches: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """Step ``stretches`` with the compiled update, in order; those left where it became unavailable."""
        assert self.fused is not None
        for k, (lo, hi, step) in enumerate(stretches):
            if not self.fused(master[lo:hi], rs.grad[lo:hi], rs.exp_avg, rs.exp_avg_sq, step, hyper, span=(lo, hi)):
                return stretches[k:]
        return []

    def _step_run_fused(self, rs: _RunState, hyper: tuple, whole: bool) -> None:
        """Update run ``rs`` with torch's fused kernel, fragment by fragment (:mod:`.torch_fused`)."""
        assert rs.torch_fused is not None
        present = range(len(rs.steps)) if whole else [k for k, i in enumerate(rs.run.fragments) if self.fragments[i].param.grad is not None]
        master = rs.master(self.kernels)
        rs.torch_fused.step(rs.steps, present, hyper)
        rs.keep_master(master, self.kernels)

    # ---- the state, per fragment -------------------------------------------------------
    def fragment_state(self, index: int) -> dict[str, Any]:
        """``fragments[index]``'s state as torch.optim holds a param's (``{}`` before its first step)."""
        rs, k = self._locate(index)
        if rs.steps[k] == 0:
            return {}
        shape, at = self.fragments[index].param.shape, rs.spans[k]
        return {
            "step": torch.tensor(float(rs.steps[k])),
            "exp_avg": rs.exp_avg.export()[at].view(shape),
            "exp_avg_sq": rs.exp_avg_sq.export()[at].view(shape),
        }

    def master_of(self, index: int) -> torch.Tensor:
        """``fragments[index]``'s fp32 master: a view, or rebuilt from its remainder (a copy)."""
        rs, k = self._locate(index)
        frag = self.fragments[index]
        if rs.remainder is None:
            return frag.param
        at = rs.spans[k]
        return bf16_rounding.join(rs.param[at], rs.remainder[at]).view(frag.param.shape)

    def load_master(self, index: int, values: torch.Tensor) -> None:
        """Make ``values`` (fp32) ``fragments[index]``'s master: split into param and remainder where kept so."""
        rs, k = self._locate(index)
        if rs.remainder is None:
            self.fragments[index].param.view(-1).copy_(values.reshape(-1))
            return
        at = rs.spans[k]
        bf16_rounding.split(values.reshape(-1).to(torch.float32).contiguous(), rs.param[at], rs.remainder[at])

    def load_fragment_states(self, states: Sequence[dict[str, Any]]) -> None:
        """``states[i]`` (torch.optim's per-param form; ``{}``: no state) becomes ``fragments[i]``'s,
        run by run (8-bit blocks span fragments), rounded to this optimizer's state dtype."""
        for rs in self._runs:
            m, v = rs.exp_avg.load().zero_(), rs.exp_avg_sq.load().zero_()
            for k, index in enumerate(rs.run.fragments):
                state = states[index]
                rs.steps[k] = int(float(state["step"])) if state else 0
                if state:
                    m[rs.spans[k]] = state["exp_avg"].reshape(-1)
                    v[rs.spans[k]] = state["exp_avg_sq"].reshape(-1)
            rs.exp_avg.save(m)
            rs.exp_avg_sq.save(v)

    def _locate(self, index: int) -> tuple[_RunState, int]:
        r, k = self._where[id(self.fragments[index].param)]
        return self._runs[r], k

    @property
    def nbytes(self) -> int:
        """Bytes kept between steps: moments, remainders and the masters' scratch (step counts are Python ints)."""
        total = self._scratch.nbytes
        for rs in self._runs:
            total += rs.exp_avg.nbytes + rs.exp_avg_sq.nbytes + (rs.remainder.nbytes if rs.remainder is not None else 0)
        return total

    # ---- torch.optim's state-dict protocol (opt.rank_state_dict) ------------------------
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        index_of = self._index_of()
        state = {}
        for i in range(len(self.fragments)):
            entry = self.fragment_state(i)
            if entry:
                entry = {k: v.clone() for k, v in entry.items()}
                if (remainder := self._remainder_of(i)) is not None:
                    entry[REMAINDER_KEY] = remainder
                state[index_of[i]] = entry
        groups, start = [], 0
        for group in self.param_groups:
            groups.append({k: v for k, v in group.items() if k != "params"} | {"params": list(range(start, start + len(group["params"])))})
            start += len(group["params"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(saved_groups)} param groups, this optimizer {len(self.param_groups)}")
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        index_of = self._index_of()
        states = [dict(state_dict["state"].get(index_of[i], {})) for i in range(len(self.fragments))]
        for i, state in enumerate(states):
            remainder = state.pop(REMAINDER_KEY, None)
            rs, k = self._locate(i)
            if remainder is not None and rs.remainder is not None:
                rs.remainder[rs.spans[k]].copy_(remainder.reshape(-1))
        self.load_fragment_states(states)

    def _remainder_of(self, index: int) -> Optional[torch.Tensor]:
        rs, k = self._locate(index)
        if rs.remainder is None:
            return None
        return rs.remainder[rs.spans[k]].clone()

    def _index_of(self) -> dict[int, int]:
        """Fragment index -> its index in torch.optim's flat numbering of the groups' params."""
        position = {id(p): n for n, p in enumerate(p for group in self.param_groups for p in group["params"])}
        return {i: position[id(f.param)] for i, f in enumerate(self.fragments)}


class _FragmentStates(Mapping[torch.Tensor, dict[str, Any]]):
    """``ShardAdamW.state``: fragment param -> its state as torch.optim holds it (read-only)."""

    def __init__(self, optimizer: ShardAdamW) -> None:
        self._optimizer = optimizer
        self._index = {id(f.param): i for i, f in enumerate(optimizer.fragments)}

    def __getitem__(self, param: torch.Tensor) -> dict[str, Any]:
        state = self._optimizer.fragment_state(self._index[id(param)])
        if not state:
            raise KeyError(param)  # no state before the fragment's first update, as torch.optim
        return state

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (f.param for i, f in enumerate(self._optimizer.fragments) if self._optimizer.fragment_state(i))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __bool__(self) -> bool:
        return any(rs.steps.count(0) < len(rs.steps) for rs in self._optimizer._runs)


def _hyper(group: dict[str, Any], decoupled: bool, allowed: tuple[str, ...] = ()) -> tuple:
    for flag in UNSUPPORTED_FLAGS:
        if group.get(flag) and flag not in allowed:
            raise ValueError(f"fxzero's own Adam update (Config.optimizer_state_dtype / param_remainders) does not implement {flag}=True")
    lr = group["lr"]
    beta1, beta2 = group["betas"]
    decoupled = decoupled or bool(group.get("decoupled_weight_decay", False))
    return (float(lr), float(beta1), float(beta2), group["eps"], group["weight_decay"], group.get("maximize", False), decoupled)


def _step_eagerly(rs: _RunState, master: torch.Tensor, hyper: tuple, stretches: Sequence[tuple[int, int, int]] = (), step: int = 0) -> None:
    """The eager update of run ``rs``: the whole run to count ``step`` where ``stretches`` is empty, else each
    stretch ``(start, stop, count)``; the moments loaded once and saved once either way."""
    m, v = rs.exp_avg.load(), rs.exp_avg_sq.load()
    reuse = rs.grad.dtype == torch.float32  # the consumed gradient holds the denominator (see _adam)
    if not stretches:
        _adam(master, rs.grad, m, v, step, hyper, reuse)
    for lo, hi, count in stretches:
        _adam(master[lo:hi], rs.grad[lo:hi], m[lo:hi], v[lo:hi], count, hyper, reuse)
    rs.exp_avg.save(m)
    rs.exp_avg_sq.save(v)


def _adam(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int, hyper: tuple,
          reuse_grad: bool = False) -> None:  # fmt: skip
    """One Adam(W) update in place, op for op ``torch.optim.adam._single_tensor_adam`` (no amsgrad).

    ``reuse_grad`` (an fp32 ``grad``): the denominator is computed into ``grad`` once the moments
    have read it, by the same kernels (``sqrt(out=)``, ``div_``, ``add_``: the same bits). The step
    consumes the gradients (the next backward overwrites them, :mod:`~fxzero.optim.gradients.stale_grads`),
    and a new tensor per run and step cost more than the arithmetic: page faults of fresh memory
    (``sqrt`` and ``div`` took 13.4 ms of a 5.24M-param remainders step on one core, 3.6 ms into
    kept memory, ``benchmarks/results/update-2026-11-28.md`` part 4)."""
    lr, beta1, beta2, eps, weight_decay, maximize, decoupled = hyper
    if maximize:
        grad = -grad
    if weight_decay != 0:
        if decoupled:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    if reuse_grad:
        denom = torch.sqrt(exp_avg_sq, out=grad).div_(bias_correction2_sqrt).add_(eps)  # grad: consumed, or a temporary of it
    else:
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
