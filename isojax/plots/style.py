"""One look for every isojax figure: the Agg backend, matplotlib's default style plus a few
settings, and a writer that saves a figure as PNG and SVG."""

from __future__ import annotations

import contextlib
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DPI = 120

# Figures are drawn under matplotlib's defaults whatever the user's matplotlibrc or style says:
# text.usetex, another font or a large figure.dpi would change the look (and usetex costs a
# LaTeX run per label). SVG text becomes paths so the file needs no font; the fixed hash salt
# and the missing date make SVGs of the same data byte-identical.
_RC = {"svg.fonttype": "path", "svg.hashsalt": "isojax"}


@contextlib.contextmanager
def styled():
    with plt.style.context("default"), matplotlib.rc_context(_RC):
        yield


def save(fig, directory: pathlib.Path, stem: str, formats=("png", "svg")) -> list[pathlib.Path]:
    """Write `fig` as directory/stem.<fmt> for each format, close it, return the paths."""
    paths = []
    try:
        with styled():
            for fmt in formats:
                path = pathlib.Path(directory) / f"{stem}.{fmt}"
                metadata = {"Date": None} if fmt == "svg" else None
                fig.savefig(path, dpi=DPI, format=fmt, metadata=metadata)
                paths.append(path)
    finally:
        plt.close(fig)
    return paths
