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
1M-character one-paragraph copies of both books, windows of 3K to 64K). A window with no sentence
end in it (code, minified data, a sentence longer than a window) is a unit of its own, cut at its last
space, and the next window starts there. Sentences come one at a time (`iter_sentences`), and a
paragraph's whitespace is collapsed a window at a time too: a build whose token budget is met
(tokens.py) reads and splits no further, whatever the text.
"""

from __future__ import annotations

import itertools
import re
from importlib.metadata import version

from syntok.segmenter import split as _syntok_split
from syntok.tokenizer import Tokenizer as _SyntokTokenizer

UNITS = ("sentence", "document")
SPLITTER = f"syntok-{version('syntok')}+w2"  # w2: a window with no sentence end is a unit (in cache keys)

_PARAGRAPH = re.compile(r"\n\s*\n")
# Whitespace runs other than one space (\s is str.split()'s whitespace: both Py_UNICODE_ISSPACE).
# Matching only those keeps re.sub's pieces few: one per word cost ~14 bytes per character.
_SPACES = re.compile(r"(?: (?=\s)|[^\S ])\s*")
_WORDS = _SyntokTokenizer()
_WINDOW = 1 << 16  # characters syntok sees at once
_RUN = re.compile(r"\s*")


def paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks, whitespace collapsed, empty ones dropped."""
    return ["".join(pieces) for pieces in _paragraphs(text)]


def _paragraphs(text: str):
    """Each paragraph as an iterator of its collapsed text in consecutive pieces (_collapsed)."""
    lo = 0
    for gap in itertools.chain(_PARAGRAPH.finditer(text), [None]):
        hi = gap.start() if gap else len(text)
        if _RUN.match(text, lo, hi).end() < hi:  # not all whitespace
            yield _collapsed(text, lo, hi)
        lo = gap.end() if gap else lo


def _collapsed(text: str, lo: int, hi: int):
    """text[lo:hi], stripped, its whitespace runs collapsed to one space, in consecutive pieces of
    about _WINDOW characters (a run split by a piece's end is collapsed whole), so that a reader that
    stops early collapses no further."""
    lo = _RUN.match(text, lo, hi).end()
    while lo < hi:
        cut = min(lo + _WINDOW, hi)
        end = _RUN.match(text, cut, hi).end()  # the whitespace run that starts at cut, if any
        piece = text[lo:cut]
        if end > cut or cut == hi:  # the run goes on past cut, or the paragraph ends: one space, or none
            piece = piece.rstrip()
            yield _SPACES.sub(" ", piece) + (" " if end < hi else "")  # not " ".join(piece.split()): a
        else:  # list of every word
            yield _SPACES.sub(" ", piece)
        lo = end


def split_sentences(text: str) -> list[str]:
    """Sentences of `text`, in order; each is an exact substring of its collapsed paragraph."""
    return list(iter_sentences(text))


def iter_sentences(text: str):
    """split_sentences one at a time: a reader that stops early splits no further."""
    for pieces in _paragraphs(text):
        yield from _paragraph_sentences(pieces)


def _paragraph_sentences(pieces):
    """The sentences of a paragraph given as consecutive pieces of its collapsed text (read as far
    as the window needs): buf holds it from the start of the next sentence on."""
    pieces, buf, more = iter(pieces), "", True
    while True:
        while more and len(buf) <= _WINDOW:
            piece = next(pieces, None)
            more = piece is not None
            buf += piece or ""
        if not buf:
            return
        last = not more and len(buf) <= _WINDOW
        cut = -1 if last else buf.rfind(" ", 1, _WINDOW)
        hi = len(buf) if last else cut if cut > 0 else _WINDOW  # no space: one giant word, cut anywhere
        window = buf[:hi]
        # syntok may rewrite token values ("n't" -> "not"); its offsets are into `window`.
        starts = [sent[0].offset for sent in _syntok_split(_WORDS.tokenize(window)) if sent] or [0]
        starts[0] = 0
        if not last and len(starts) == 1:  # no sentence ends in this window: its text is one unit
            if window.strip():
                yield window.strip()
            buf = buf[hi:]
            continue
        if not last:  # restart at a sentence start well inside the window: a cut near it (in a
            # parenthesis, a quotation) can move syntok's boundaries shortly before it
            inside = [a for a in starts[1:] if a <= len(window) - _WINDOW // 16]  # re-split: <= 1/16
            starts = starts[:starts.index(inside[-1]) + 1] if inside else starts
        ends = starts[1:] + [len(window)] if last else starts[1:]
        for a, b in zip(starts, ends):
            sent = buf[a:b].strip()
            if sent:
                yield sent
        if last:
            return
        buf = buf[starts[-1]:]


def text_units(text: str, unit: str):
    """The units of one record, lazily: its sentences, or the whole text as one document."""
    if unit == "sentence":
        return iter_sentences(text)
    if unit == "document":
        return [text] if text.strip() else []
    raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
