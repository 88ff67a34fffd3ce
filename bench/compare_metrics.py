"""Largest differences between two result folders' metrics.json (e.g. 1 and 2 GPUs).

    python -m bench.compare_metrics out/1gpu out/2gpu
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(a: str, b: str) -> int:
    one, two = (json.loads((Path(p) / "metrics.json").read_text()) for p in (a, b))
    assert one["tokens"] == two["tokens"], (one["tokens"], two["tokens"])
    worst: dict[str, tuple[float, str]] = {}
    for x, y in zip(one["layers"], two["layers"]):
        assert x["count"] == y["count"] and x.get("intra_tokens") == y.get("intra_tokens"), x["name"]
        for key, v in x.items():
            if isinstance(v, float) and isinstance(y.get(key), float):
                d = abs(v - y[key]) / max(1.0, abs(v))
                if d >= worst.get(key, (-1.0, ""))[0]:
                    worst[key] = (d, x["name"])
    print(f"{one['tokens']:,} tokens; largest relative difference (absolute below 1) per metric:")
    for key, (d, layer) in sorted(worst.items(), key=lambda kv: -kv[1][0]):
        print(f"  {key:<24}{d:10.2e}  ({layer})")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
