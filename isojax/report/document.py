"""The report as data: sections of figures with their tables, rendered by `render`.

Figures are written as soon as they are drawn (PNG, SVG and the table as CSV in full
precision, all in figures/), so that no more than one matplotlib figure is open at a time.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import pathlib
import re

from isojax.plots import save


@dataclasses.dataclass
class Table:
    columns: list[str]
    rows: list[list]           # cells: str, int, float (NaN shown as a dash) or None


@dataclasses.dataclass
class Item:
    caption: str
    table: Table | None
    figure: str | None = None  # stem of figures/<stem>.png|.svg|.csv; None: a table alone
    fold: bool = False         # HTML: folded under <details> (long tables)


@dataclasses.dataclass
class Section:
    anchor: str
    title: str
    text: str
    items: list[Item] = dataclasses.field(default_factory=list)
    note: str | None = None    # the one line shown instead when there is nothing to draw


def stem(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.\-]+", "_", text).strip("_") or "x"


def cell(value) -> str:
    """Table text: floats to 6 significant digits, NaN/None as a dash."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if isinstance(value, float):
        return format(value, ".6g")
    return str(value)


class Figures:
    """Writes figures and their tables into `directory` and hands back report Items."""

    def __init__(self, directory: pathlib.Path):
        self.directory = pathlib.Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.names: list[str] = []

    def add(self, fig, name: str, caption: str, table: Table | None) -> Item:
        name = stem(name)
        if name in self.names:
            raise ValueError(f"figure {name} written twice")
        self.names.append(name)
        save(fig, self.directory, name)
        if table is not None:
            write_csv(self.directory / f"{name}.csv", table)
        return Item(caption, table, name)


def write_csv(path: pathlib.Path, table: Table) -> None:
    """Full precision (repr of floats), empty cells for missing values."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(table.columns)
        for row in table.rows:
            w.writerow(["" if v is None or (isinstance(v, float) and not math.isfinite(v)) else repr(v)
                        if isinstance(v, float) else v for v in row])
