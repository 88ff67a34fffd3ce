"""Debiased linear CKA between consecutive states on the sample (Nguyen et al. 2021; Kornblith et al.
2019 with the unbiased HSIC estimator of Song et al. 2012)."""

from isojax.stats.measures.base import Measure, Metric


def _frobenius_products(x, y, xp):
    """(||X^T Y||_F^2, ||X^T X||_F^2, ||Y^T Y||_F^2) from the smaller of the D x D and K x K products."""
    k, d = x.shape
    if d <= k:
        return xp.sum((x.T @ y) ** 2), xp.sum((x.T @ x) ** 2), xp.sum((y.T @ y) ** 2)
    gx, gy = x @ x.T, y @ y.T
    return xp.sum(gx * gy), xp.sum(gx * gx), xp.sum(gy * gy)


def readout(x_KxD, y_KxD) -> dict:
    """HSIC_u(K, L) / sqrt(HSIC_u(K, K) HSIC_u(L, L)), K = X X^T and L = Y Y^T of the centered points
    (centering leaves HSIC_u unchanged), HSIC_u Song et al.'s unbiased estimator: with K~, L~ the
    Grams with a zero diagonal, [tr(K~L~) + 1^T K~ 1 1^T L~ 1 / ((n-1)(n-2)) - 2/(n-2) 1^T K~ L~ 1]
    / (n(n-3)); tr(K~L~) = ||X^T Y||_F^2 - Sum_i K_ii L_ii and K~1 = X X^T 1 - diag(K): no n x n
    matrix where D < n. NaN for fewer than 4 points or where HSIC_u(K, K) or HSIC_u(L, L) is not
    positive (a state that does not vary)."""
    xp = x_KxD.__array_namespace__()
    x, y = xp.astype(x_KxD, xp.float64), xp.astype(y_KxD, xp.float64)
    n = x.shape[0]
    if n < 4:
        return {"cka_debiased": xp.asarray(xp.nan, dtype=xp.float64)}
    x, y = x - xp.mean(x, axis=0), y - xp.mean(y, axis=0)
    cross = _frobenius_products(x, y, xp)
    diag = {"x": xp.sum(x * x, axis=1), "y": xp.sum(y * y, axis=1)}
    rows = {"x": x @ xp.sum(x, axis=0) - diag["x"], "y": y @ xp.sum(y, axis=0) - diag["y"]}  # K~ 1
    totals = {a: xp.sum(rows[a]) for a in rows}  # 1^T K~ 1

    def hsic(frobenius, a, b):
        return (frobenius - xp.sum(diag[a] * diag[b]) + totals[a] * totals[b] / ((n - 1) * (n - 2))
                - 2.0 / (n - 2) * xp.sum(rows[a] * rows[b])) / (n * (n - 3))

    xy, xx, yy = hsic(cross[0], "x", "y"), hsic(cross[1], "x", "x"), hsic(cross[2], "y", "y")
    ok = (xx > 0) & (yy > 0)
    return {"cka_debiased": xp.where(ok, xy / xp.sqrt(xp.where(ok, xx * yy, 1.0)), xp.nan)}


MEASURE = Measure(
    metrics=(Metric("cka_debiased", "similarity", "debiased linear CKA with the previous state"),),
    reads="pairs", readout=readout, paper="Nguyen et al. 2021; Song et al. 2012", on_by_default=False, to_final=True,
    readme_row="| `cka_debiased` | **off by default** (`--measure cka_debiased`; 58 ms a 410m checkpoint on an H200, 1.9% of a 2M-token loop); debiased linear CKA of state i with state i − 1 on the K sampled tokens: "
               "HSIC_u(K, L)/√(HSIC_u(K, K)·HSIC_u(L, L)) with K = XXᵀ, L = YYᵀ the two states' linear Grams and "
               "HSIC_u the unbiased estimator of Song et al. 2012 (as Kornblith's `feature_space_linear_cka"
               "(debiased=True)` computes it: from the D×D or K×K products, in float64); unlike `cka.json`'s "
               "linear CKA, near 0 for unrelated states at any K/D. Null for `embed`, without a sample, for fewer "
               "than 4 tokens and where a state does not vary. In a sweep also each layer against itself at the final "
               "checkpoint (`cka_debiased_to_final`: \"Sweeps\") | Nguyen et al. 2021; Song et al. 2012 |")
