"""Model shape: one frozen dataclass for every supported family (its family fields default to
GPT-NeoX), presets in `configs/`, and strict readers of Hugging Face `config.json` files (GPT-NeoX
here, the other families in isojax.model.family_configs).

The reader is an allowlist: every attribute of a config.json is either implemented, checked
to have the one value we implement, or known to be irrelevant to a forward pass without
dropout. Anything else is refused, so a checkpoint we would compute wrongly never runs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from isojax.errors import UserError
from isojax.model.family_configs import IRRELEVANT_KEYS, READERS

def _configs_dir() -> Path:
    """configs/ of a source checkout, else the copy installed as package data of isojax.configs."""
    here = Path(__file__).resolve().parents[2] / "configs"
    if here.is_dir():
        return here
    import importlib.resources
    return Path(str(importlib.resources.files("isojax.configs")))


CONFIGS_DIR = _configs_dir()

# GELU activations by Hugging Face name -> whether the tanh approximation is used.
ACTIVATIONS = {"gelu": False, "gelu_new": True, "gelu_fast": True, "gelu_pytorch_tanh": True}
# Every activation a model may use (GPT-NeoX: the GELUs only).
ALL_ACTIVATIONS = (*ACTIVATIONS, "relu", "silu")
NORMS = ("layer", "rms", "layer_no_affine")

@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of a model of any supported family (GPT-NeoX unless the family fields say otherwise).
    `num_states` = L + 2: embed, block_1..block_L, final_ln (the final norm, whatever its kind)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    hidden_act: str = "gelu"
    rotary_pct: float = 0.25
    rotary_emb_base: float = 10000.0
    max_position_embeddings: int = 2048
    layer_norm_eps: float = 1e-5
    use_parallel_residual: bool = True
    name: str = ""
    # The family fields (README "Model families"); their defaults are GPT-NeoX's.
    family: str = "gpt_neox"            # Hugging Face model_type: which module and tensor reader
    num_kv_heads: int | None = None     # key/value heads, each shared by num_heads / num_kv_heads query heads
    attention_head_dim: int | None = None  # None: hidden_size / num_heads
    norm: str = "layer"                 # "layer" (scale and bias), "rms" (RMSNorm) or "layer_no_affine"
    qkv_bias: bool = True
    out_bias: bool = True               # the attention's output projection
    mlp_bias: bool = True
    gated_mlp: bool = False             # SwiGLU: down(act(gate x) * up x) instead of down(act(up x))
    learned_positions: bool = False     # a learned absolute position table instead of rotary
    position_offset: int = 0            # row of position 0 in that table (OPT: 2)
    shared_input_norm: bool = False     # parallel residual with one norm read by both sublayers (Falcon-7B)
    post_sublayer_norms: bool = False   # OLMo-2: x + norm(attn(x)), then + norm(mlp(.)); no pre-norms
    qk_norm: bool = False               # OLMo-2: RMSNorm over all heads of q and of k before rotary
    clip_qkv: float | None = None       # OLMo: q, k, v clamped to [-clip, clip]
    tie_word_embeddings: bool = False

    def __post_init__(self):
        if self.attention_head_dim is None and self.hidden_size % self.num_heads:
            raise UserError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.kv_heads:
            raise UserError(f"num_heads {self.num_heads} is not a multiple of the key/value heads {self.kv_heads}")
        acts = ACTIVATIONS if self.family == "gpt_neox" else ALL_ACTIVATIONS
        if self.hidden_act not in acts:
            raise UserError(f"hidden_act {self.hidden_act!r} is not implemented (have: {', '.join(acts)})")
        if self.norm not in NORMS:
            raise UserError(f"norm {self.norm!r} is not implemented (have: {', '.join(NORMS)})")
        if self.rotary_dims % 2:
            raise UserError(f"rotary dims {self.rotary_dims} must be even")

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.rotary_pct)  # as Hugging Face: int() truncates

    @property
    def num_states(self) -> int:
        return self.num_layers + 2

    @property
    def state_names(self) -> list[str]:
        return ["embed"] + [f"block_{i}" for i in range(1, self.num_layers + 1)] + ["final_ln"]

    def non_embedding_params(self) -> int:
        d, f, k = self.hidden_size, self.intermediate_size, self.head_dim
        qkv = (self.num_heads + 2 * self.kv_heads) * k
        norm = {"layer": 2 * d, "rms": d, "layer_no_affine": 0}[self.norm]
        norms = 1 if self.shared_input_norm else 2
        attention = d * qkv + self.qkv_bias * qkv + self.num_heads * k * d + self.out_bias * d
        mlp_in = 2 if self.gated_mlp else 1
        mlp = mlp_in * (d * f + self.mlp_bias * f) + f * d + self.mlp_bias * d
        qk_norms = qkv - self.kv_heads * k if self.qk_norm else 0
        return self.num_layers * (norms * norm + attention + mlp + qk_norms) + norm

    def position_table_rows(self) -> int:
        """Rows of the learned position table (0 with rotary positions)."""
        return self.max_position_embeddings + self.position_offset if self.learned_positions else 0

    def param_count(self) -> int:
        embeddings = (1 if self.tie_word_embeddings else 2) * self.vocab_size + self.position_table_rows()
        return self.non_embedding_params() + embeddings * self.hidden_size

    def flops_per_token(self, gram: bool = True) -> float:
        """Forward matmul FLOPs per token (2 x non-embedding params) plus 2d^2 per state for a Gram."""
        return 2.0 * self.non_embedding_params() + (2.0 * self.hidden_size ** 2 * self.num_states if gram else 0.0)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def from_hf_dict(raw: dict, name: str = "") -> ModelConfig:
    """Build a config from a Hugging Face `config.json` dict of a supported family, refusing what
    we don't implement."""
    model_type = raw.get("model_type", "gpt_neox")
    if model_type == "gpt_neox":
        return _gpt_neox_from_hf(raw, name)
    if model_type not in READERS:
        raise UserError(f"model_type {model_type!r} is not supported; isojax runs {', '.join(['gpt_neox', *READERS])}")
    return ModelConfig(name=name, **READERS[model_type](dict(raw)))


def _gpt_neox_from_hf(raw: dict, name: str) -> ModelConfig:
    cfg = dict(raw)

    def check(key, ok, expected):
        if key in cfg and cfg[key] is not None and not ok(cfg[key]):
            raise UserError(f"config attribute {key}={cfg[key]!r} is not implemented (isojax supports {expected})")

    check("attention_bias", lambda v: v is True, "attention_bias=true")
    check("rope_scaling", lambda v: False, "no rope_scaling")
    check("sliding_window", lambda v: False, "no sliding_window")
    num_heads = cfg.get("num_attention_heads")
    if "head_dim" in cfg and cfg["head_dim"] is not None and num_heads:
        check("head_dim", lambda v: v * num_heads == cfg.get("hidden_size"), "head_dim = hidden_size / heads")

    rotary_pct = cfg.get("rotary_pct", 0.25)
    rotary_base = cfg.get("rotary_emb_base", 10000.0)
    rope = cfg.get("rope_parameters")
    if rope is not None:
        extra = set(rope) - {"rope_type", "rope_theta", "partial_rotary_factor"}
        if rope.get("rope_type", "default") != "default" or extra:
            raise UserError(f"rope_parameters {rope!r} not implemented (isojax supports the default rotary embedding)")
        rotary_pct = rope.get("partial_rotary_factor", rotary_pct)
        rotary_base = rope.get("rope_theta", rotary_base)

    handled = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
               "hidden_act", "rotary_pct", "rotary_emb_base", "rope_parameters", "max_position_embeddings",
               "layer_norm_eps", "use_parallel_residual", "attention_bias", "rope_scaling", "head_dim",
               "sliding_window"}
    unknown = sorted(set(cfg) - handled - IRRELEVANT_KEYS)
    if unknown:
        raise UserError(f"config attribute(s) {', '.join(unknown)} not implemented by isojax's GPT-NeoX; "
                        "refusing rather than computing something different")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size") if k not in cfg]
    if missing:
        raise UserError(f"config.json lacks {', '.join(missing)}")
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]), num_heads=int(cfg["num_attention_heads"]),
        intermediate_size=int(cfg["intermediate_size"]), hidden_act=cfg.get("hidden_act", "gelu"),
        rotary_pct=float(rotary_pct), rotary_emb_base=float(rotary_base),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-5)),
        use_parallel_residual=bool(cfg.get("use_parallel_residual", True)), name=name)


def read_hf_config(path: str | Path, name: str = "") -> ModelConfig:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UserError(f"{path}: no config.json")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: unreadable config.json ({e})") from None
    return from_hf_dict(raw, name=name)


def preset_names() -> list[str]:
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))


def _preset_json(stem: str) -> dict | None:
    """The preset file's dict (a Hugging Face config.json plus isojax's `hub_id` and `_comment`), or None."""
    path = CONFIGS_DIR / f"{stem}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def shape_only(name: str) -> bool:
    """Whether `name` is a preset of shapes with no hub model behind it (no `hub_id` in its file:
    falcon-mqa-1b, mistral-1b): only random:<name> runs it."""
    raw = _preset_json(name) if "/" not in name else None
    return raw is not None and not raw.get("hub_id")


def base_preset(name: str) -> str | None:
    """The preset of a hub model's name: 'pythia-410m-deduped' -> 'pythia-410m' (same shapes; the
    -deduped twins are GPT-NeoX's only), 'qwen2-1.5b' -> 'qwen2-1.5b'; None if the name is no preset
    or a preset of shapes only (shape_only)."""
    if "/" in name:
        return None
    for stem in dict.fromkeys((name, name.removesuffix("-deduped"))):
        raw = _preset_json(stem)
        if raw is not None and raw.get("hub_id") and (stem == name or raw.get("model_type", "gpt_neox") == "gpt_neox"):
            return stem
    return None


def preset(name: str) -> ModelConfig:
    """The config of a preset name (a hub model's, a -deduped twin's, or a shape-only preset's)."""
    base = base_preset(name) or (name if shape_only(name) else None)
    if base is None:
        raise UserError(f"unknown preset {name!r}; presets: {', '.join(preset_names())} (and -deduped variants "
                        "of the Pythia ones)")
    raw = _preset_json(base)
    raw.pop("_comment", None)
    return from_hf_dict(raw, name=name)


def hub_id(name: str) -> str | None:
    """Hub repository of a preset name ('pythia-70m-deduped' -> 'EleutherAI/pythia-70m-deduped',
    'llama-1b' -> its file's hub_id, TinyLlama/TinyLlama_v1.1); None for a shape-only preset (its
    random weights take the bundled tokenizer)."""
    base = base_preset(name)
    if base is None:
        if shape_only(name):
            return None
        raise UserError(f"unknown preset {name!r}; presets: {', '.join(preset_names())}")
    repo = _preset_json(base)["hub_id"]
    return repo if name == base else f"{repo.split('/')[0]}/{name}"
