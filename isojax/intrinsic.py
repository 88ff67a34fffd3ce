"""Public name of the intrinsic-dimension estimators (isojax.intrinsic.twonn, mle, mom, ...); they
live in isojax.stats.intrinsic."""

from isojax.stats import intrinsic as _impl
from isojax.stats.intrinsic import intrinsic_dimensions, knn_distances, mle, mom, twonn  # noqa: F401


def __getattr__(name: str):
    return getattr(_impl, name)
