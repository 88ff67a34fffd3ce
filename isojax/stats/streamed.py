"""Float64 read-out of the streamed measures beyond finalize's: massive activations and InterSim by
position band (stats/accumulators.py keeps them; finalize.finalize adds them to every layer).

- `massive_max`: the largest |x| over every valid token and dimension of the state (exact: a max),
  `massive_dim` its dimension, `massive_token` the token id, `massive_position` its position in
  its sequence; equal maxima go to the earliest token by (sequence index, position), then the
  lowest dim, so that any device count, batch size or resume gives the same answer.
- `inter_sim_by_position`: per position band [0, 1), [1, 16), [16, 128), [128, inf)
  (accumulators.POSITION_BANDS), `{"lo", "hi", "tokens", "inter_sim"}` with the InterSim of the
  states at those positions. A position is the token's position in its packed segment as the
  model sees it: a sequence longer than the row is cut into windows, each starting at 0.
Positions left out by --skip-positions are in no band; a band of fewer than 2 tokens and a state
of no tokens read out null, with one log line.
"""

from __future__ import annotations

import numpy as np

from isojax.log import log
from isojax.stats.accumulators import _COUNT_BITS, POSITION_BANDS, Accumulators


def _massive(max_G, at_Gx4) -> dict:
    """The largest over groups, ties to the earliest token (accumulators.massive_merge's order)."""
    seen = [g for g in range(len(max_G)) if max_G[g] >= 0]
    if not seen:
        return dict(massive_max=None, massive_dim=None, massive_token=None, massive_position=None)
    g = min(seen, key=lambda g: (-float(max_G[g]), int(at_Gx4[g, 3]), int(at_Gx4[g, 2]), int(at_Gx4[g, 0])))
    dim, token, position, _ = (int(v) for v in at_Gx4[g])
    return dict(massive_max=float(max_G[g]), massive_dim=dim, massive_token=token, massive_position=position)


def _bands(n_B, sum_BxD) -> list[dict]:
    out = []
    for b, lo in enumerate(POSITION_BANDS):
        n = int(n_B[b])
        inter = (float(sum_BxD[b] @ sum_BxD[b]) - n) / (n * n - n) if n >= 2 else None
        hi = POSITION_BANDS[b + 1] if b + 1 < len(POSITION_BANDS) else None
        out.append({"lo": lo, "hi": hi, "tokens": n, "inter_sim": inter})
    return out


def streamed_measures(acc: Accumulators) -> list[dict]:
    """Per state: massive_* and inter_sim_by_position, from accumulators merged over devices (on
    the host or the devices)."""
    max_GxS, at_GxSx4 = np.asarray(acc.massive_max_GxS), np.asarray(acc.massive_at_GxSx4)
    n_BxS = (np.asarray(acc.band_count_hi_BxS, np.int64) << _COUNT_BITS) + np.asarray(acc.band_count_lo_BxS, np.int64)
    sum_BxSxD = np.asarray(acc.band_unit_sum_BxSxD.hi, np.float64) + np.asarray(acc.band_unit_sum_BxSxD.lo, np.float64)
    out = [{**_massive(max_GxS[:, s], at_GxSx4[:, s]), "inter_sim_by_position": _bands(n_BxS[:, s], sum_BxSxD[:, s])}
           for s in range(max_GxS.shape[1])]
    if out and out[0]["massive_max"] is None:
        log("massive_max, massive_dim, massive_token and massive_position are null: no token was measured")
    few = [f"[{b['lo']}, {'inf' if b['hi'] is None else b['hi']}) ({b['tokens']} tokens)"
           for b in (out[0]["inter_sim_by_position"] if out else []) if b["tokens"] < 2]
    if few:
        log(f"inter_sim_by_position is null in the position bands of fewer than 2 tokens: {', '.join(few)}")
    return out
