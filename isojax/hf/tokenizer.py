"""The model's tokenizer: the checkpoint's own `tokenizer.json`, else its hub repository's
(huggingface_hub cache first, then network), else -- announced -- GPT-NeoX-20B's tokenizer,
which Pythia uses and isojax ships (isojax/data/gpt-neox-20b-tokenizer.json, Apache-2.0).
Returns (tokenizers.Tokenizer, description)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from isojax.log import log
from isojax.model.config import ModelConfig
from isojax.errors import UserError


def _from_hub(repo: str, revision: str | None = None) -> Path | None:
    """tokenizer.json of the repository at `revision` (None: main), never another revision's."""
    try:
        from huggingface_hub import hf_hub_download
        from isojax.hf.network import hub_reachable
        try:
            return Path(hf_hub_download(repo, "tokenizer.json", revision=revision, local_files_only=True))
        except Exception:
            return Path(hf_hub_download(repo, "tokenizer.json", revision=revision)) if hub_reachable() else None
    except Exception:
        return None


BUNDLED = Path(__file__).resolve().parents[1] / "data" / "gpt-neox-20b-tokenizer.json"


def load_tokenizer(directory: Path | None, cfg: ModelConfig, hub_repo: str | None = None,
                   hub_revision: str | None = None):
    path = Path(directory) / "tokenizer.json" if directory is not None else None
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
    if tok.get_vocab_size() > cfg.vocab_size:
        raise UserError(f"tokenizer vocabulary ({tok.get_vocab_size()}) is larger than the model's "
                        f"({cfg.vocab_size}): token ids would index past the embedding"
                        + ("; put the model's own tokenizer.json beside its weights" if path == BUNDLED else ""))
    return tok, desc
