"""The model's tokenizer: the checkpoint's own `tokenizer.json`, else its hub repository's
(huggingface_hub cache first, then network), else -- random weights only -- a byte-level
stand-in, announced loudly. Returns (tokenizers.Tokenizer, description)."""

from __future__ import annotations

import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from isojax.config import GPTNeoXConfig
from isojax.errors import UserError


def byte_level_tokenizer() -> Tokenizer:
    """One token per UTF-8 byte (ids 0..255), GPT-2 style byte alphabet."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _from_hub(repo: str) -> Path | None:
    try:
        from huggingface_hub import hf_hub_download
        from isojax.network import hub_reachable
        try:
            return Path(hf_hub_download(repo, "tokenizer.json", local_files_only=True))
        except Exception:
            return Path(hf_hub_download(repo, "tokenizer.json")) if hub_reachable() else None
    except Exception:
        return None


def load_tokenizer(directory: Path | None, cfg: GPTNeoXConfig, hub_repo: str | None = None):
    path = Path(directory) / "tokenizer.json" if directory is not None else None
    if path is None or not path.is_file():
        path = _from_hub(hub_repo) if hub_repo else None
    if path is not None and path.is_file():
        try:
            tok, desc = Tokenizer.from_file(str(path)), str(path)
        except Exception as e:
            raise UserError(f"{path}: unreadable tokenizer ({e})") from None
    elif directory is None:  # random weights: any tokenizer serves, but say so
        print("isojax: WARNING: no GPT-NeoX tokenizer available offline; using a byte-level tokenizer "
              "(one token per byte) with the random weights", file=sys.stderr)
        tok, desc = byte_level_tokenizer(), "byte-level (offline stand-in)"
    else:
        raise UserError(f"{directory}: no tokenizer.json (put the model's tokenizer.json beside its weights)")
    if tok.get_vocab_size() > cfg.vocab_size:
        raise UserError(f"tokenizer vocabulary ({tok.get_vocab_size()}) is larger than the model's "
                        f"({cfg.vocab_size}): token ids would index past the embedding")
    return tok, desc
