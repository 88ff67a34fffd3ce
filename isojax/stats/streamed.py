"""Float64 read-out of InterSim by position band (stats/accumulators.py keeps its sums;
finalize.finalize adds it to every layer; massive activations: stats/measures/massive_activations.py).

- `inter_sim_by_position`: per position band [0, 1), [1, 16), [16, 128), [128, inf)
  (accumulators.POSITION_BANDS), `{"lo", "hi", "tokens", "inter_sim"}` with the InterSim of the
  states at those positions. A position is the token's position in its packed segment as the
  model sees it: a sequence longer than the row is cut into windows, each starting at 0.
Positions left out by --skip-positions are in no band; a band of fewer than 2 tokens reads out
null, with one log line.
"""

from __future__ import annotations

import numpy as np

from isojax.log import log
from isojax.stats.accumulators import _COUNT_BITS, POSITION_BANDS, Accumulators


def _bands(n_B, sum_BxD) -> list[dict]:
    out = []
    for b, lo in enumerate(POSITION_BANDS):
        n = int(n_B[b])
        inter = (float(sum_BxD[b] @ sum_BxD[b]) - n) / (n * n - n) if n >= 2 else None
        hi = POSITION_BANDS[b + 1] if b + 1 < len(POSITION_BANDS) else None
        out.append({"lo": lo, "hi": hi, "tokens": n, "inter_sim": inter})
    return out


def streamed_measures(acc: Accumulators) -> list[dict]:
    """Per state: inter_sim_by_position, from accumulators merged over devices (on the host or the devices)."""
    n_BxS = (np.asarray(acc.band_count_hi_BxS, np.int64) << _COUNT_BITS) + np.asarray(acc.band_count_lo_BxS, np.int64)
    sum_BxSxD = np.asarray(acc.band_unit_sum_BxSxD.hi, np.float64) + np.asarray(acc.band_unit_sum_BxSxD.lo, np.float64)
    out = [{"inter_sim_by_position": _bands(n_BxS[:, s], sum_BxSxD[:, s])} for s in range(n_BxS.shape[1])]
    few = [f"[{b['lo']}, {'inf' if b['hi'] is None else b['hi']}) ({b['tokens']} tokens)"
           for b in (out[0]["inter_sim_by_position"] if out else []) if b["tokens"] < 2]
    if few:
        log(f"inter_sim_by_position is null in the position bands of fewer than 2 tokens: {', '.join(few)}")
    return out
