"""Text units: `document` (a record's text, verbatim) and `sentence` (the papers' unit).

Sentences come from syntok (rule-based, pure Python, offline). It was chosen over
blingfire, sentencex, pysbd and a regex baseline by speed and by quality on the books
(see bench/bench_data.py): it is the only fast-enough splitter that gets "Mr."/"Dr.",
ellipses, `"Where?" she asked.` and quotes inside paragraphs all right.

A sentence never crosses a paragraph (blank line). Inside a paragraph whitespace runs,
hard line wraps included, are collapsed to one space, so a wrapped book and its unwrapped
copy give the same sentences.
"""

from __future__ import annotations

import re
from importlib.metadata import version

from syntok.segmenter import split as _syntok_split
from syntok.tokenizer import Tokenizer as _SyntokTokenizer

UNITS = ("sentence", "document")
SPLITTER = f"syntok-{version('syntok')}"

_PARAGRAPH = re.compile(r"\n\s*\n")
_WORDS = _SyntokTokenizer()


def paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks, whitespace collapsed, empty ones dropped."""
    out = []
    for block in _PARAGRAPH.split(text):
        para = " ".join(block.split())
        if para:
            out.append(para)
    return out


def split_sentences(text: str) -> list[str]:
    """Sentences of `text`, in order; each is an exact substring of its collapsed paragraph."""
    out = []
    for para in paragraphs(text):
        # syntok may rewrite token values ("n't" -> "not"); its offsets are into `para`.
        starts = [sent[0].offset for sent in _syntok_split(_WORDS.tokenize(para)) if sent]
        if not starts:
            continue
        starts[0] = 0
        for lo, hi in zip(starts, starts[1:] + [len(para)]):
            sent = para[lo:hi].strip()
            if sent:
                out.append(sent)
    return out


def text_units(text: str, unit: str) -> list[str]:
    """The units of one record: its sentences, or the whole text as one document."""
    if unit == "sentence":
        return split_sentences(text)
    if unit == "document":
        return [text] if text.strip() else []
    raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
