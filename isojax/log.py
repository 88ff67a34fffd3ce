"""The one logger: progress and notes on stderr, each line prefixed "isojax: "."""

from __future__ import annotations

import sys


def log(msg: str) -> None:
    print(f"isojax: {msg}", file=sys.stderr, flush=True)


def gb_apart(more: int, less: int) -> tuple[str, str]:
    """Two byte counts, more > less, in GB with the fewest decimals (one at least) that show them
    apart: a refusal's "need 0.23 GB, 0.22 GB free", never "need 0.2 GB, 0.2 GB free"."""
    for decimals in range(1, 10):
        a, b = f"{more / 1e9:.{decimals}f}", f"{less / 1e9:.{decimals}f}"
        if float(a) > float(b):
            break
    return f"{a} GB", f"{b} GB"
