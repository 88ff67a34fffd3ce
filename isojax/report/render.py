"""report.html (one self-contained file: images as base64 data URIs, inline CSS, no scripts, no
external resources) and report.md (images as files in figures/) from the report's sections."""

from __future__ import annotations

import base64
import html
import pathlib
import re

from isojax.report.document import Section, Table, cell

_CSS = """
body { font-family: sans-serif; max-width: 1150px; margin: 2em auto; padding: 0 1em; color: #222; line-height: 1.4; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2em; margin-top: 2em; }
figure { margin: 1.2em 0 0.4em; } figure img { max-width: 100%; }
figcaption { font-size: 0.9em; color: #444; margin-top: 0.3em; }
.table { overflow-x: auto; margin: 0.4em 0 1.6em; }
table { border-collapse: collapse; font-size: 0.8em; font-variant-numeric: tabular-nums; }
th, td { border: 1px solid #ccc; padding: 2px 7px; text-align: left; white-space: nowrap; }
th { background: #f2f2f2; } .n { text-align: right; }
.note { color: #777; font-style: italic; } code { background: #f4f4f4; padding: 0 3px; }
nav ul { columns: 2; }
"""


def _inline(text: str) -> str:
    """Escaped text with `code` and *emphasis* (the only markup captions use)."""
    out = html.escape(text)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    return re.sub(r"\*([^*]+)\*", r"<em>\1</em>", out)


_NUMBER = re.compile(r"-?\d+(\.\d*)?(e[-+]?\d+)?|–|")


def _is_number(v) -> bool:
    if isinstance(v, str):
        return bool(_NUMBER.fullmatch(v))
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def _numeric(table: Table) -> list[bool]:
    """Columns (but the first) whose cells are all numbers or empty: right-aligned."""
    if not table.rows:
        return [False] * len(table.columns)
    return [i > 0 and all(_is_number(v) for v in col) for i, col in enumerate(zip(*table.rows))]


def _cell_tag(tag: str, text: str, right: bool) -> str:
    return f'<{tag} class="n">{html.escape(text)}</{tag}>' if right else f"<{tag}>{html.escape(text)}</{tag}>"


def _html_table(table: Table) -> str:
    right = _numeric(table)
    head = "".join(_cell_tag("th", str(c), r) for c, r in zip(table.columns, right))
    body = "".join("<tr>" + "".join(_cell_tag("td", cell(v), r) for v, r in zip(row, right)) + "</tr>\n"
                   for row in table.rows)
    return f'<div class="table"><table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody></table></div>\n'


def to_html(title: str, intro: str, sections: list[Section], figdir: pathlib.Path) -> str:
    parts = [f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
             f"<title>{html.escape(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
             f"<h1>{html.escape(title)}</h1>\n<p>{_inline(intro)}</p>\n<nav><ul>\n"]
    parts += [f'<li><a href="#{s.anchor}">{html.escape(s.title)}</a></li>\n' for s in sections]
    parts.append("</ul></nav>\n")
    for sec in sections:
        parts.append(f'<section id="{sec.anchor}">\n<h2>{html.escape(sec.title)}</h2>\n<p>{_inline(sec.text)}</p>\n')
        if sec.note:
            parts.append(f'<p class="note">{_inline(sec.note)}</p>\n')
        for item in sec.items:
            if item.figure:
                data = base64.b64encode((figdir / f"{item.figure}.png").read_bytes()).decode("ascii")
                parts.append(f'<figure id="fig-{item.figure}">\n<img alt="{html.escape(item.figure)}" '
                             f'src="data:image/png;base64,{data}">\n'
                             f"<figcaption>{_inline(item.caption)}</figcaption>\n</figure>\n")
            elif not item.fold:
                parts.append(f"<p>{_inline(item.caption)}</p>\n")
            if item.table is not None:
                table = _html_table(item.table)
                parts.append(f"<details><summary>{_inline(item.caption)}</summary>\n{table}</details>\n"
                             if item.fold else table)
        parts.append("</section>\n")
    parts.append("</body>\n</html>\n")
    return "".join(parts)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _md_table(table: Table) -> str:
    lines = ["| " + " | ".join(_md_cell(str(c)) for c in table.columns) + " |",
             "|" + "|".join("--:" if r else ":--" for r in _numeric(table)) + "|"]
    lines += ["| " + " | ".join(_md_cell(cell(v)) for v in row) + " |" for row in table.rows]
    return "\n".join(lines) + "\n"


def to_markdown(title: str, intro: str, sections: list[Section]) -> str:
    parts = [f"# {title}\n\n{intro}\n\n"]
    parts += [f"- [{s.title}](#{s.anchor})\n" for s in sections]
    for sec in sections:
        parts.append(f'\n<a id="{sec.anchor}"></a>\n\n## {sec.title}\n\n{sec.text}\n\n')
        if sec.note:
            parts.append(f"*{sec.note}*\n\n")
        for item in sec.items:
            if item.figure:
                parts.append(f"![{item.figure}](figures/{item.figure}.png)\n\n"
                             f"{item.caption} ([SVG](figures/{item.figure}.svg), [CSV](figures/{item.figure}.csv))\n\n")
            else:
                parts.append(f"{item.caption}\n\n")
            if item.table is not None:
                parts.append(_md_table(item.table) + "\n")
    return "".join(parts)
