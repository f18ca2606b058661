"""Param all-gathers: the step time of each way to run them, and where their time goes.

    python benchmarks/param_gather_overlap.py [--steps N] [--warmup W]

One run, 2 gloo ranks (``fxzero.testing``, 1 thread each), the GPT of
``examples/train_gpt.py`` (3.25M params, tied embedding/head), seq 128, batch 8 per rank,
AdamW, ``Config(bucket_size=1_000_000)``, ``torch.compile(model, backend="fxzero")``
(Inductor inside). Four configs run in the same rank function, one after the other, each on
a fresh model + optimizer from the same seed and the same batches, with
``torch._dynamo.reset()`` between them (each compiles once):

* **default** (``overlap_param_gather=False``, ``overlap_param_gather_with_optimizer_step=True``):
  ``step()`` updates one bucket at a time and launches its gather as soon as its shard is
  done; it returns once every gather has landed.
* **before** (both off: the default until issue 47): ``step()`` updates every shard, then
  gathers every bucket and waits.
* **opt-in overlap** (``overlap_param_gather=True``, with-step on): ``step()`` launches the
  gathers bucket by bucket and returns; the next forward waits for each bucket right before
  its first reader.
* **opt-in overlap, whole update** (``overlap_param_gather=True``, with-step off).

1. **Step time**: *iteration* = wall time of the timed steps (forward + backward + opt.step +
   zero_grad + the next batch), one barrier before the first and one after the last (gloo's
   barrier waits for in-flight work: one between steps would finish the opt-in mode's gathers
   untimed), divided by the steps, slower rank: the figure the ratios use. Also per step,
   median of the slower rank: step, forward and opt.step. Ratios of the default to the opt-in
   overlap mode and to "before".
2. **Per bucket, default**, from monkeypatched ``ParamSync``/``Publish``: *update* = time from
   the previous bucket's launch (or the update's start) to this bucket's publish, *in
   flight* = from its launch to the start of its ``work.wait()``, *exposed wait* = time
   blocked in ``work.wait()``.
3. **Per bucket, opt-in overlap**: in flight and exposed wait in the next forward.

Targets: the default's step time <= 1.02x the opt-in overlap mode's; with overlap on, no
forward wait longer than 5% of the forward time after the first bucket.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_gpt import ModelArgs, Transformer, get_batch, load_bytes  # noqa: E402

import fxzero  # noqa: E402
import fxzero.backend  # noqa: E402, F401  (registers the "fxzero" backend)
from fxzero.optim.update.flat_update import FlatUpdate  # noqa: E402
from fxzero.optim.params.param_sync import ParamSync  # noqa: E402
from fxzero.optim.update.publish import Publish  # noqa: E402
from fxzero.testing import close_pools, run_ranks  # noqa: E402

WORLD, BUCKET, TARGET, STEP_TARGET = 2, 1_000_000, 0.05, 1.02
BATCH = types.SimpleNamespace(seq=128, global_batch=8 * WORLD)  # what get_batch reads
CONFIGS = {  # label: (overlap_param_gather, overlap_param_gather_with_optimizer_step)
    "default": (False, True),
    "before": (False, False),
    "opt-in overlap": (True, True),
    "opt-in overlap, whole update": (True, False),
}


# ---- on every rank ----------------------------------------------------------------------
class _TimedWork:
    """Wraps a gather's Work: records when something blocks on it and for how long."""

    def __init__(self, work, index: int, launched: float, waits: list) -> None:
        self.work, self.index, self.launched, self.waits = work, index, launched, waits

    def wait(self) -> bool:
        start = time.perf_counter()
        self.work.wait()
        self.waits.append((self.index, self.launched, start, time.perf_counter()))
        return True


@contextlib.contextmanager
def _instrumented(marks: dict, waits: list):
    """Record when the step starts updating (``ParamSync.begin``), when each bucket is
    published (its update done), its gather's launch, and the span of its ``work.wait()``;
    fxzero's own logic runs unchanged."""
    orig_launch, orig_begin, orig_publish = ParamSync._launch_next, ParamSync.begin, Publish.__call__
    orig_step, orig_apart = FlatUpdate.step, FlatUpdate.step_apart

    def step(self, *args):
        marks["update"] = time.perf_counter()
        orig_step(self, *args)

    def step_apart(self, *args):
        marks["update"] = time.perf_counter()
        orig_apart(self, *args)

    def _launch_next(self):
        index = self.order[self._next_launch]
        marks.setdefault("launched", {})[index] = time.perf_counter()
        orig_launch(self)
        self._works[index] = _TimedWork(self._works[index], index, marks["launched"][index], waits)

    def begin(self):
        marks["begin"] = time.perf_counter()
        orig_begin(self)

    def publish(self, index):
        marks.setdefault("published", {})[index] = time.perf_counter()
        orig_publish(self, index)

    ParamSync._launch_next, ParamSync.begin, Publish.__call__ = _launch_next, begin, publish
    FlatUpdate.step, FlatUpdate.step_apart = step, step_apart
    try:
        yield
    finally:
        ParamSync._launch_next, ParamSync.begin, Publish.__call__ = orig_launch, orig_begin, orig_publish
        FlatUpdate.step, FlatUpdate.step_apart = orig_step, orig_apart


def _span(names: list[str]) -> str:
    blocks = sorted({int(n.split(".")[1]) for n in names if n.startswith("layers.")})
    other = sorted({n.split(".")[0] for n in names if not n.startswith("layers.")})
    return " + ".join(([f"layers {','.join(map(str, blocks))}"] if blocks else []) + other)


class _Job:
    """One config's model, optimizer and compiled model on this rank, stepped on its own batches."""

    def __init__(self, overlap: bool, with_step: bool, data: torch.Tensor) -> None:
        torch.manual_seed(0)
        self.model = Transformer(ModelArgs())
        params = list(self.model.parameters())
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        config = fxzero.Config(bucket_size=BUCKET, overlap_param_gather=overlap, overlap_param_gather_with_optimizer_step=with_step)
        self.opt = fxzero.DistributedOptimizer(groups, torch.optim.AdamW, lr=2e-3, betas=(0.9, 0.95), module=self.model, config=config)
        self.cmodel = torch.compile(self.model, backend="fxzero")
        self.data, self.done = data, 0
        self.out = {"step": [], "fwd": [], "opt": [], "losses": [], "buckets_timed": [], "waits": [], "iteration": [], "trace": None}

    def run(self, steps: int, marks: dict, waits: list, timed: bool) -> None:
        """``steps`` steps with no barrier between them; timed: their wall time and breakdowns."""
        rank, world = dist.get_rank(), dist.get_world_size()
        dist.barrier()  # one before and one after: gloo's barrier would finish in-flight gathers untimed
        start = time.perf_counter()
        for _ in range(steps):
            self.done += 1
            x, y = get_batch(self.data, self.done, BATCH, rank, world, torch.device("cpu"))
            waits.clear(), marks.clear()
            t0 = time.perf_counter()
            loss = self.cmodel(x, y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            self.opt.step()
            t3 = time.perf_counter()
            self.opt.zero_grad()
            t4 = time.perf_counter()
            self.out["losses"].append(loss.item())
            if timed:
                self.out["step"].append(t4 - t0), self.out["fwd"].append(t1 - t0), self.out["opt"].append(t3 - t2)
                # bucket -> (in flight, exposed, wait start into the forward, waited in the forward?)
                self.out["waits"].append({i: (s - l, e - s, s - t0, t0 <= s <= t1) for i, l, s, e in waits})
                self.out["buckets_timed"].append(_bucket_times(marks, waits, t2))
                self.out["trace"] = _trace(marks, waits, t2, t3)
        self.opt.finish_param_sync()
        dist.barrier()
        if timed:
            self.out["iteration"].append((time.perf_counter() - start, steps))

    def result(self) -> dict:
        names = {id(p): n for n, p in self.model.named_parameters()}
        out = dict(self.out, order=list(self.opt.runtime.param_sync.order))
        out["iteration"] = [sum(t for t, _ in self.out["iteration"]) / sum(n for _, n in self.out["iteration"])]
        out["buckets"] = {b.index: (b.param_data.numel(), _span([names[id(p)] for p in b.params])) for b in self.opt.runtime.buckets}
        out["params"] = [p.detach().clone() for p in self.model.parameters()]
        return out


def _trace(marks: dict, waits: list, backward_end: float, step_end: float) -> list[tuple[str, int, float, float]]:
    """One step's schedule inside ``opt.step()``: (what, bucket, start, end) in ms from its start."""
    begin, update = marks.get("begin", backward_end), marks.get("update", backward_end)
    events, previous = [], update
    if begin > update:  # every shard updated before the gathers ("before")
        events.append(("update", -1, update, begin))
        previous = begin
    for index in sorted(marks.get("published", {}), key=marks["published"].get):
        events.append(("update", index, previous, marks["published"][index]))
        previous = marks.get("launched", {}).get(index, marks["published"][index])
        events.append(("publish", index, marks["published"][index], previous))
    for index, launched, start, end in waits:
        if start >= backward_end:
            events.append(("gather in flight", index, launched, start))
            events.append(("wait", index, start, end))
    return [(what, index, 1e3 * (a - backward_end), 1e3 * (b - backward_end)) for what, index, a, b in events] + [
        ("opt.step", -1, 0.0, 1e3 * (step_end - backward_end))]


def _bucket_times(marks: dict, waits: list, backward_end: float) -> dict:
    """This step's per-bucket update, gather in flight and wait inside ``step()`` (ms)."""
    published, launched = marks.get("published", {}), marks.get("launched", {})
    previous, out = max(marks.get("begin", backward_end), marks.get("update", backward_end)), {}
    in_step = {i: (s, e) for i, _, s, e in waits if s >= marks.get("begin", backward_end)}
    for index in sorted(published, key=published.get):
        update = published[index] - previous
        previous = launched.get(index, published[index])
        start, end = in_step.get(index, (previous, previous))
        out[index] = (update, start - launched.get(index, start), end - start)
    return out


def _rank_main(steps: int, warmup: int, rounds: int) -> dict:
    """Every config built and warmed up first, then ``rounds`` rounds of ``steps // rounds``
    timed steps per config, the configs' order rotating each round (drift of the machine's
    speed spreads over all of them)."""
    data = torch.frombuffer(bytearray(load_bytes(None)), dtype=torch.uint8).long()
    marks: dict = {}
    waits: list = []
    with _instrumented(marks, waits):
        jobs = {label: _Job(*flags, data) for label, flags in CONFIGS.items()}
        for job in jobs.values():
            job.run(warmup, marks, waits, timed=False)
        labels = list(jobs)
        for r in range(rounds):
            for label in labels[r % len(labels):] + labels[: r % len(labels)]:
                jobs[label].run(steps // rounds, marks, waits, timed=True)
    return {label: job.result() for label, job in jobs.items()}


# ---- in the parent ----------------------------------------------------------------------
def _worst(res: list[dict], label: str, key: str) -> list[float]:
    return [max(v) for v in zip(*(r[label][key] for r in res))]


def _ms(values) -> float:
    return 1e3 * statistics.median(values)


def _step_table(res: list[dict]) -> dict:
    med = {label: {k: _ms(_worst(res, label, k)) for k in ("iteration", "step", "fwd", "opt")} for label in CONFIGS}
    rows = [[label, f"overlap_param_gather={o}, with_optimizer_step={w}", f"{med[label]['iteration']:.1f}", f"{med[label]['step']:.1f}",
             f"{med[label]['fwd']:.1f}", f"{med[label]['opt']:.1f}", f"{res[0][label]['losses'][-1]:.4f}"] for label, (o, w) in CONFIGS.items()]
    print("## step time (ms; iteration: wall time of the timed steps / steps, slower rank; the rest: median, slower rank per step)\n")
    print(tabulate(rows, headers=["config", "Config", "iteration", "step", "forward", "opt.step", "final loss (rank 0)"],
                   tablefmt="github", disable_numparse=True))
    return med


def _default_breakdown(res: list[dict]) -> None:
    runs = [r["default"] for r in res]
    order, rows = runs[0]["order"], []
    per_step = list(zip(*(r["buckets_timed"] for r in runs)))  # per timed step, each rank's records
    for pos, index in enumerate(order):
        cols = [_ms([max(rank[index][k] for rank in s) for s in per_step]) for k in range(3)]
        numel, span = runs[0]["buckets"][index]
        rows.append([pos, index, f"{numel:,}", span, *(f"{c:.2f}" for c in cols)])
    print(f"\n## per bucket, default (median over {len(per_step)} timed steps of the slower rank; inside opt.step)\n")
    print(tabulate(rows, headers=["update pos", "bucket", "elements", "params", "update ms", "gather in flight ms", "exposed wait ms"],
                   tablefmt="github", disable_numparse=True))
    print("\n(update: from the previous bucket's launch, or the update's start, to this bucket's publish; in flight: from its launch "
          "to the start of its wait, which comes after every bucket is updated.)")


def _overlap_breakdown(res: list[dict], fwd: float) -> float:
    on = [r["opt-in overlap"] for r in res]
    order, rows, worst = on[0]["order"], [], 0.0
    steps = list(zip(*(r["waits"] for r in on)))
    for pos, index in enumerate(order):
        per = [[w[index] for w in s if index in w] for s in steps]
        flight = _ms([max(v[0] for v in s) for s in per if s])
        exposed = _ms([max(v[1] for v in s) for s in per if s])
        at = _ms([max(v[2] for v in s) for s in per if s])
        inside = sum(all(v[3] for v in s) for s in per if s)
        numel, span = on[0]["buckets"][index]
        if pos > 0:
            worst = max(worst, exposed / fwd)
        rows.append([pos, index, f"{numel:,}", span, f"{flight:.2f}", f"{exposed:.3f}", f"{exposed / fwd:.2%}", f"{at:.2f}",
                     f"{inside}/{len(per)}"])
    print(f"\n## per bucket, opt-in overlap (median over {len(steps)} timed steps of the slower rank; forward median {fwd:.1f} ms)\n")
    print(tabulate(rows, headers=["fwd pos", "bucket", "elements", "params", "in flight ms", "exposed wait ms",
                                  "% of forward", "wait at ms into fwd", "waited in fwd"],
                   tablefmt="github", disable_numparse=True))
    return worst


def _write_trace(res: list[dict], path: str) -> None:
    """The last timed step's ``opt.step()`` of "default" and "before" on each rank, as a
    chrome://tracing file and a picture (matplotlib, if installed)."""
    import json

    events = [{"name": f"{what} {index}" if index >= 0 else what, "ph": "X", "pid": f"rank {rank}", "tid": label,
               "ts": 1e3 * start, "dur": 1e3 * (end - start)}
              for rank, r in enumerate(res) for label in ("default", "before") for what, index, start, end in r[label]["trace"]]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{path}.json").write_text(json.dumps({"traceEvents": events}))
    print(f"\nschedule of one opt.step() per rank: {path}.json (chrome://tracing or ui.perfetto.dev)", end="")
    try:
        from param_gather_schedule import draw
    except ImportError as error:
        print(f"; no picture ({error})")
        return
    draw(res, f"{path}.png")
    print(f" and {path}.png")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="timed steps per config")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compile)")
    p.add_argument("--rounds", type=int, default=3, help="rounds the timed steps are split into (configs rotate)")
    p.add_argument("--trace", default="benchmarks/results/param_gather_schedule", help="writes PATH.json (chrome://tracing) and PATH.png")
    args = p.parse_args()
    if args.steps < args.rounds or args.warmup < 2 or args.rounds < 1:
        p.error("need --steps >= --rounds >= 1 and --warmup >= 2")
    print(f"# param all-gathers — torch {torch.__version__}, gloo, {WORLD} ranks x 1 thread, "
          f"GPT seq {BATCH.seq} batch {BATCH.global_batch // WORLD}/rank, bucket_size {BUCKET:,}; "
          f"{args.warmup} warm-up + {args.steps} timed steps per config\n")
    start = time.perf_counter()
    try:
        res = run_ranks(WORLD, _rank_main, args.steps, args.warmup, args.rounds, timeout=1800)
    finally:
        close_pools()
    print(f"(ran in {time.perf_counter() - start:.0f} s)\n")
    med = _step_table(res)
    step = {label: m["iteration"] for label, m in med.items()}
    same = all(r[a]["losses"] == r["before"]["losses"] for r in res for a in CONFIGS)
    params = all(torch.equal(x, y) for r in res for a in CONFIGS for x, y in zip(r[a]["params"], r["before"]["params"]))
    print(f"\ndefault / opt-in overlap = {step['default'] / step['opt-in overlap']:.3f}x (target <= {STEP_TARGET}x); "
          f"default / before = {step['default'] / step['before']:.3f}x; opt.step default - before = "
          f"{med['default']['opt'] - med['before']['opt']:+.1f} ms")
    print(f"losses identical in all four configs: {same}; final params bitwise equal to 'before' in all four: {params}")
    _default_breakdown(res)
    worst = _overlap_breakdown(res, med["opt-in overlap"]["fwd"])
    verdict = "PASS" if worst <= TARGET else "FAIL"
    print(f"\ntarget: with overlap on, no forward wait longer than {TARGET:.0%} of the forward time after the first "
          f"bucket: worst {worst:.2%} -> {verdict}")
    if args.trace:
        _write_trace(res, args.trace)


if __name__ == "__main__":
    main()
