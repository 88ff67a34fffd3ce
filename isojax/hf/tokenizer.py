"""The model's tokenizer: the checkpoint's own `tokenizer.json`, else its GPT-2-style files
(`vocab.json` + `merges.txt` of a byte-level BPE, as OPT's repositories ship), else its hub
repository's `tokenizer.json` (huggingface_hub cache first, then network), else -- announced --
GPT-NeoX-20B's tokenizer, which Pythia uses and isojax ships
(isojax/data/gpt-neox-20b-tokenizer.json, Apache-2.0). Returns (tokenizers.Tokenizer, description).
`tokenizer_bos` says which BOS token it has and whether Hugging Face adds it by default."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tokenizers import Tokenizer

from isojax.log import log
from isojax.model.config import ModelConfig
from isojax.errors import UserError


def _from_hub(repo: str, revision: str | None = None) -> Path | None:
    """tokenizer.json of the repository at `revision` (None: main), never another revision's,
    checked against the hub's hash (isojax.hf.verify: a damaged copy is an error and leaves the cache)."""
    try:
        from huggingface_hub import hf_hub_download
        from isojax.hf.network import hub_reachable
        try:
            path = Path(hf_hub_download(repo, "tokenizer.json", revision=revision, local_files_only=True))
        except Exception:
            if not hub_reachable():
                return None
            path = Path(hf_hub_download(repo, "tokenizer.json", revision=revision))
    except Exception:
        return None
    from isojax.hf.verify import verify_snapshot
    verify_snapshot(path.parent, ["tokenizer.json"], f"{repo}@{revision or 'main'}")
    return path


BUNDLED = Path(__file__).resolve().parents[1] / "data" / "gpt-neox-20b-tokenizer.json"
BPE_TOKENIZERS = ("GPT2Tokenizer", "GPT2TokenizerFast")  # tokenizer_config.json's classes read from the BPE files


def byte_level_bpe(directory: Path):
    """The tokenizer GPT2TokenizerFast builds from `vocab.json` and `merges.txt` (a byte-level BPE;
    tokenizer_config.json's `add_prefix_space`, default false), or None where the folder has no
    such files or its tokenizer_config.json names another class."""
    vocab, merges, conf = (Path(directory) / n for n in ("vocab.json", "merges.txt", "tokenizer_config.json"))
    if not (vocab.is_file() and merges.is_file()):
        return None
    try:
        config = json.loads(conf.read_text()) if conf.is_file() else {}
    except (OSError, ValueError) as e:
        raise UserError(f"{conf}: unreadable tokenizer_config.json ({e})") from None
    if config.get("tokenizer_class", BPE_TOKENIZERS[0]) not in BPE_TOKENIZERS:
        return None
    from tokenizers import decoders, models, pre_tokenizers
    try:
        tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    except Exception as e:
        raise UserError(f"{vocab}, {merges}: unreadable tokenizer files ({e})") from None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=bool(config.get("add_prefix_space", False)))
    tok.decoder = decoders.ByteLevel()
    return tok


def load_tokenizer(directory: Path | None, cfg: ModelConfig, hub_repo: str | None = None,
                   hub_revision: str | None = None):
    path = Path(directory) / "tokenizer.json" if directory is not None else None
    if (path is None or not path.is_file()) and directory is not None:
        bpe = byte_level_bpe(Path(directory))
        if bpe is not None:
            return _checked(bpe, cfg, f"{directory} (vocab.json + merges.txt)", False)
    if path is None or not path.is_file():
        path = _from_hub(hub_repo, hub_revision) if hub_repo else None
    if path is None or not path.is_file():
        # GPT-NeoX-20B's tokenizer (Pythia's; Apache-2.0), shipped with isojax
        log(f"WARNING: the model's own tokenizer is not available{' offline' if directory is None else ''}; "
              "using the GPT-NeoX-20B tokenizer shipped with isojax (Pythia's)")
        path = BUNDLED
    try:
        tok, desc = Tokenizer.from_file(str(path)), str(path) if path != BUNDLED else "gpt-neox-20b (bundled)"
    except Exception as e:
        raise UserError(f"{path}: unreadable tokenizer ({e})") from None
    if path == BUNDLED and directory is None and tok.get_vocab_size() > cfg.vocab_size:
        # random weights (no checkpoint folder) of a preset whose vocabulary is smaller (gpt2-xl, opt-1.3b,
        # llama-1b, mistral-1b): the ids carry no meaning for them, only their range must fit the embedding
        log(f"random weights with a vocabulary of {cfg.vocab_size}: the bundled tokenizer cut to its first "
            f"{cfg.vocab_size} ids")
        tok, desc = first_ids(path, cfg.vocab_size), f"gpt-neox-20b (bundled, first {cfg.vocab_size} ids)"
    return _checked(tok, cfg, desc, path == BUNDLED)


def first_ids(path: Path, vocab_size: int) -> Tokenizer:
    """The BPE tokenizer of `path` without its ids >= vocab_size: those tokens, the merges that make
    or read them and the added tokens among them are dropped, so every word still encodes (into
    shorter pieces, down to the byte alphabet) and every id lies below vocab_size."""
    raw = json.loads(Path(path).read_text())
    model = raw["model"]
    vocab = {t: i for t, i in model["vocab"].items() if i < vocab_size}
    if model.get("type") != "BPE" or any(len(t) == 1 and t not in vocab for t in model["vocab"]):
        raise UserError(f"{path}: cannot cut this tokenizer to {vocab_size} ids (it would lose byte tokens)")
    pair = lambda m: m.split(" ") if isinstance(m, str) else m
    model["vocab"] = vocab
    model["merges"] = [m for m in model["merges"]
                       if (p := pair(m))[0] in vocab and p[1] in vocab and p[0] + p[1] in vocab]
    raw["added_tokens"] = [t for t in raw.get("added_tokens", []) if t["id"] < vocab_size]
    return Tokenizer.from_str(json.dumps(raw))


def _checked(tok, cfg: ModelConfig, desc: str, bundled: bool):
    if tok.get_vocab_size() > cfg.vocab_size:
        raise UserError(f"tokenizer vocabulary ({tok.get_vocab_size()}) is larger than the model's "
                        f"({cfg.vocab_size}): token ids would index past the embedding"
                        + ("; put the model's own tokenizer.json beside its weights" if bundled else ""))
    return tok, desc


BUNDLED_BOS = "<|endoftext|>"  # the bos_token of Pythia's tokenizer_config.json, for the bundled tokenizer


@dataclasses.dataclass(frozen=True)
class Bos:
    """A tokenizer's beginning-of-sequence token: its id (None: it has none), and whether Hugging
    Face's tokenizer puts it before a text by default (add_special_tokens=True)."""
    id: int | None
    default: bool

    def resolve(self, choice: str, tokenizer: str) -> int | None:
        """The BOS id a run puts before each unit under --bos `choice` (auto, on, off), or None."""
        if choice == "off" or (choice == "auto" and not self.default):
            return None
        if self.id is None:
            raise UserError(f"--bos on: the tokenizer ({tokenizer}) has no BOS token")
        return self.id


def tokenizer_bos(tok, directory: Path | None, description: str) -> Bos:
    """What Hugging Face's tokenizer of these files does with add_special_tokens=True (transformers 5,
    tested): a tokenizer.json's post-processor puts its BOS first or not (Llama's <s>; GPT-NeoX's none;
    tokenizer_config.json's add_bos_token is not read then); GPT-2-style files (`description` says
    vocab.json + merges.txt) have no post-processor, and tokenizer_config.json's add_bos_token (default
    false) says. The BOS id: the post-processor's, else tokenizer_config.json's bos_token, else (the
    bundled tokenizer) Pythia's <|endoftext|>."""
    config = {}
    path = Path(directory) / "tokenizer_config.json" if directory is not None else None
    if path is not None and path.is_file():
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"{path}: unreadable tokenizer_config.json ({e})") from None
    config = config if isinstance(config, dict) else {}
    name = config.get("bos_token")
    name = name.get("content") if isinstance(name, dict) else name
    backend = Tokenizer.from_str(getattr(tok, "backend_tokenizer", tok).to_str())  # a copy: truncation off
    backend.no_truncation()
    backend.no_padding()
    enc = backend.encode("a", add_special_tokens=True)
    leading = enc.ids[0] if enc.special_tokens_mask and enc.special_tokens_mask[0] else None
    named = tok.token_to_id(name) if isinstance(name, str) else None
    bundled = tok.token_to_id(BUNDLED_BOS) if description.startswith("gpt-neox-20b (bundled") else None
    bos = next((i for i in (leading, named, bundled) if i is not None), None)
    default = config.get("add_bos_token") is True if "vocab.json + merges.txt" in description else leading is not None
    return Bos(bos, default and bos is not None)
