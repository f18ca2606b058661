"""What the benchmarks' charts share: the optional matplotlib (``pip install -e .[bench]``)."""

from __future__ import annotations

from typing import Any, Optional


def pyplot(path: str) -> Optional[Any]:
    """``matplotlib.pyplot`` on the file-only Agg backend, or None (saying so) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"\n(matplotlib not installed: no {path}; `pip install -e .[bench]`)")
        return None
    return plt


def save(fig: Any, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nwrote {path}")
