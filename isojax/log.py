"""The one logger: progress and notes on stderr, each line prefixed "isojax: "."""

from __future__ import annotations

import sys


def log(msg: str) -> None:
    print(f"isojax: {msg}", file=sys.stderr, flush=True)
