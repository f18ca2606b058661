"""The most bytes torch's allocator held at once inside named phases of a run, from the profiler's
memory records (every allocation and free of a CPU or GPU tensor, in time order).

Why not the peak resident set: it also counts the pages of torch's own libraries that the first
kernels of a run fault in, the interpreter, gloo's threads and freed memory the C allocator keeps,
about 130 MB of a small model's first steps here, none of it the training step's. This counts
tensors only, from before the model is built, so the model states are in it."""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch.profiler import ProfilerActivity, profile, record_function


class AllocatedPeak:
    """``with tracker: ...`` profiles; ``with tracker.phase("bwd1"): ...`` names a window;
    ``peaks()`` gives each window's most allocated bytes (counted from the tracker's start)."""

    def __init__(self) -> None:
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.names: list[str] = []

    def __enter__(self) -> "AllocatedPeak":
        self._profile.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._profile.__exit__(*exc)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.names.append(name)
        with record_function(name):
            yield

    def peaks(self) -> dict[str, int]:
        events = list(self._profile.profiler.kineto_results.events())
        memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
        windows = {e.name(): (e.start_ns(), e.end_ns()) for e in events if e.name() in self.names}
        peaks, allocated = dict.fromkeys(self.names, 0), 0
        for time, nbytes in memory:
            allocated += nbytes
            for name, (start, end) in windows.items():
                if start <= time <= end:
                    peaks[name] = max(peaks[name], allocated)
        return peaks
