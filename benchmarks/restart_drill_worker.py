"""examples/train_gpt.py with a lost rank injected: what benchmarks/restart_drill.py runs under torchrun.

    torchrun --nproc-per-node 2 --max-restarts 1 benchmarks/restart_drill_worker.py --kill-at N [train_gpt.py's flags]

On torchrun's first attempt (TORCHELASTIC_RESTART_COUNT 0) the last rank SIGKILLs itself at the
start of step N; on the restart, and on every other rank, this is train_gpt.py unchanged.
``--lose-node-at N --marker F`` instead stops node 1 at step N for benchmarks/multinode_drill.py.
"""

import argparse
import os
import signal
import sys
import time
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


def lose_node_at(lose_at: int, marker: Path) -> None:
    """Wrap train_gpt.train_step so that at step lose_at node 1's first rank writes ``marker`` and
    stops: benchmarks/multinode_drill.py then SIGKILLs that node's agent and workers together.
    Armed once per drill (the marker's existence disarms it), as the replacement node's agent is
    a first attempt too."""
    train_step = train_gpt.train_step

    def stopping_train_step(job, step, loss_sum):
        if step == lose_at and os.environ.get("GROUP_RANK") == "1" and os.environ.get("LOCAL_RANK") == "0":
            marker.write_text(str(step))
            time.sleep(3600)  # until SIGKILLed with its node
        return train_step(job, step, loss_sum)

    train_gpt.train_step = stopping_train_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--kill-at", type=int, help="the step at which the last rank dies")
    p.add_argument("--lose-node-at", type=int, help="the step at which node 1 stops for the multi-node drill to kill it")
    p.add_argument("--marker", type=Path, help="with --lose-node-at: the file that tells the drill node 1 has stopped")
    args, rest = p.parse_known_args()
    if args.kill_at is not None and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        kill_last_rank_at(args.kill_at)
    if args.lose_node_at is not None and not args.marker.exists():
        lose_node_at(args.lose_node_at, args.marker)
    sys.argv[1:] = rest  # the rest is train_gpt.py's
    train_gpt.main()


if __name__ == "__main__":
    main()
