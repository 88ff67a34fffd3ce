"""Text units: `document` (a record's text, verbatim) and `sentence` (the papers' unit).

Sentences come from syntok (rule-based, pure Python, offline). It was chosen over
blingfire, sentencex, pysbd and a regex baseline by speed and by quality on the books
(see bench/bench_data.py): it is the only fast-enough splitter that gets "Mr."/"Dr.",
ellipses, `"Where?" she asked.` and quotes inside paragraphs all right.

A sentence never crosses a paragraph (blank line). Inside a paragraph whitespace runs,
hard line wraps included, are collapsed to one space, so a wrapped book and its unwrapped
copy give the same sentences.

Memory stays bounded for any record: syntok sees a long paragraph _WINDOW characters at a
time (its tokens of a whole paragraph cost ~40 bytes per character: a 50 MB one-line record
peaked at 2.4 GB in a worker; now 0.4 GB). A window that ends inside the paragraph is cut at a
space; its sentences up to its last sentence start before the window's last sixteenth are
kept and the next window starts there, so the sentences are those of the whole paragraph
(syntok decides a boundary from the words around it, which the window holds; identical on
1M-character one-paragraph copies of both books, windows of 3K to 64K). A sentence longer than
a window continues into the next one, whole. Sentences come one at a time (`iter_sentences`):
a build whose token budget is met (tokens.py) splits no further.
"""

from __future__ import annotations

import itertools
import re
from importlib.metadata import version

from syntok.segmenter import split as _syntok_split
from syntok.tokenizer import Tokenizer as _SyntokTokenizer

UNITS = ("sentence", "document")
SPLITTER = f"syntok-{version('syntok')}"

_PARAGRAPH = re.compile(r"\n\s*\n")
# Whitespace runs other than one space (\s is str.split()'s whitespace: both Py_UNICODE_ISSPACE).
# Matching only those keeps re.sub's pieces few: one per word cost ~14 bytes per character.
_SPACES = re.compile(r"(?: (?=\s)|[^\S ])\s*")
_WORDS = _SyntokTokenizer()
_WINDOW = 1 << 16  # characters syntok sees at once


def paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks, whitespace collapsed, empty ones dropped."""
    return list(_paragraphs(text))


def _paragraphs(text: str):
    lo = 0
    for gap in itertools.chain(_PARAGRAPH.finditer(text), [None]):
        block = text[lo:gap.start() if gap else len(text)]
        para = _SPACES.sub(" ", block).strip()  # not " ".join(block.split()): a list of every word
        if para:
            yield para
        lo = gap.end() if gap else lo


def split_sentences(text: str) -> list[str]:
    """Sentences of `text`, in order; each is an exact substring of its collapsed paragraph."""
    return list(iter_sentences(text))


def iter_sentences(text: str):
    """split_sentences one at a time: a reader that stops early splits no further."""
    for para in _paragraphs(text):
        yield from _paragraph_sentences(para)


def _paragraph_sentences(para: str):
    head, lo = 0, 0  # para[head:lo]: the start of a sentence longer than a window
    while lo < len(para):
        last = len(para) - lo <= _WINDOW
        cut = -1 if last else para.rfind(" ", lo + 1, lo + _WINDOW)
        hi = len(para) if last else cut if cut > lo else lo + _WINDOW  # no space: one giant word, cut anywhere
        window = para[lo:hi]
        # syntok may rewrite token values ("n't" -> "not"); its offsets are into `window`.
        starts = [sent[0].offset for sent in _syntok_split(_WORDS.tokenize(window)) if sent] or [0]
        starts[0] = 0
        if not last and len(starts) == 1:  # no sentence ends in this window
            lo = hi
            continue
        if not last:  # restart at a sentence start well inside the window: a cut near it (in a
            # parenthesis, a quotation) can move syntok's boundaries shortly before it
            inside = [a for a in starts[1:] if a <= len(window) - _WINDOW // 16]  # re-split: <= 1/16
            starts = starts[:starts.index(inside[-1]) + 1] if inside else starts
        ends = starts[1:] + [len(window)] if last else starts[1:]
        for i, (a, b) in enumerate(zip(starts, ends)):
            sent = para[(head if i == 0 else lo + a):lo + b].strip()
            if sent:
                yield sent
        if last:
            break
        head = lo = lo + starts[-1]


def text_units(text: str, unit: str):
    """The units of one record, lazily: its sentences, or the whole text as one document."""
    if unit == "sentence":
        return iter_sentences(text)
    if unit == "document":
        return [text] if text.strip() else []
    raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
