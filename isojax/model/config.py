"""Model shape: one frozen dataclass for every supported family (its family fields default to
GPT-NeoX). Hugging Face's config.json files, and the presets, are read into it by the family
registry (isojax.hf.family); nothing here reads a file.
"""

from __future__ import annotations

import dataclasses

from isojax.errors import UserError

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
    family: str = "gpt_neox"            # Hugging Face model_type: which tensor reader (and GPT-NeoX's tree)
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
    norm_plus_one: bool = False         # Gemma: RMSNorm's gain is 1 + the weight, applied in float32
    embed_scale: bool = False           # Gemma: embeddings times sqrt(hidden_size) (rounded to the weights' dtype)
    unembed_bias: bool = False          # Phi: the lm_head has a bias (a parameter no state reads)

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
    def neox_tree(self) -> bool:
        """GPT-NeoX's parameter tree (isojax.hf.family.gpt_neox; isojax.model.layers says what differs)."""
        return self.family == "gpt_neox"

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
        return self.non_embedding_params() + embeddings * self.hidden_size + self.unembed_bias * self.vocab_size

    def flops_per_token(self, gram: bool = True) -> float:
        """Forward matmul FLOPs per token (2 x non-embedding params) plus 2d^2 per state for a Gram."""
        return 2.0 * self.non_embedding_params() + (2.0 * self.hidden_size ** 2 * self.num_states if gram else 0.0)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
