"""The corpus pipeline: inputs -> units -> cached token ids -> packed single-source batches.

    corpus = load_corpus(paths, unit="sentence", sources=None)    # None -> default corpus
    cache = tokenize_corpus(corpus, tokenizer, cache_dir=..., max_len=2048)
    cache = stream_tokens(corpus, tokenizer, ...)   # or: the cache, else a TokenStream building it
    for batch in pack_batches(cache, rows=B, row_len=T):          # Batch.cursor resumes
        ...
"""

from isojax.data.packing import Batch, BatchIterator, PackStats, pack_batches, plan_stats
from isojax.data.readers import Corpus, default_corpus, load_corpus
from isojax.data.tokens import TokenCache, TokenStream, stream_tokens, tokenize_corpus
from isojax.data.units import UNITS, split_sentences

__all__ = [
    "Batch", "BatchIterator", "Corpus", "PackStats", "TokenCache", "TokenStream", "UNITS", "default_corpus",
    "load_corpus", "pack_batches", "plan_stats", "split_sentences", "stream_tokens", "tokenize_corpus",
]
