"""examples/train_gpt.py with a lost rank injected: what benchmarks/restart_drill.py runs under torchrun.

    torchrun --nproc-per-node 2 --max-restarts 1 benchmarks/restart_drill_worker.py --kill-at N [train_gpt.py's flags]

On torchrun's first attempt (TORCHELASTIC_RESTART_COUNT 0) the last rank SIGKILLs itself at the
start of step N; on the restart, and on every other rank, this is train_gpt.py unchanged.
"""

import argparse
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import train_gpt  # noqa: E402


def kill_last_rank_at(kill_at: int) -> None:
    """Wrap train_gpt.train_step so that the last rank dies (SIGKILL: no cleanup, no exception) at step kill_at."""
    train_step = train_gpt.train_step

    def dying_train_step(job, step, loss_sum):
        if step == kill_at and job.rank == job.world - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return train_step(job, step, loss_sum)

    train_gpt.train_step = dying_train_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--kill-at", type=int, required=True, help="the step at which the last rank dies")
    args, rest = p.parse_known_args()
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        kill_last_rank_at(args.kill_at)
    sys.argv[1:] = rest  # the rest is train_gpt.py's
    train_gpt.main()


if __name__ == "__main__":
    main()
