"""The Hugging Face PyTorch peer of the throughput benchmark (issue 7).

What a careful PyTorch user writes today to get isojax's statistics from Pythia:
a bf16 GPT-NeoX with SDPA attention under ``torch.inference_mode()``, padded batches
under a token budget (optionally length-sorted), ``output_hidden_states=True``, and per
state: unit vectors û = x/‖x‖ in float32, Σû, per-token Σû by ``index_add_`` into a
float32 [S, V, d] tensor, and (``gram=True``) Σx and Σxxᵀ by a float32 matmul.

Choices that favour the peer, as a careful user would make them:
- the base model ``gpt_neox`` is called, so no logits ([tokens, 50304] per batch) are made;
- ``use_cache=False``: no KV cache is built;
- real-token rows are gathered with host-built indices (no boolean-mask sync);
- cuDNN attention is left out of SDPA's choices: on Hopper (torch 2.11) SDPA picks it
  first and it builds a graph for every new [B, T] (~8 ms each; a length-sorted run meets
  a new shape nearly every batch). Flash (no padding) and memory-efficient (padding mask)
  kernels run as fast once warm and need no per-shape build;
- length-sorted batches are formed first, then visited in a seeded random order, so
  warm-up and an early stop see representative batches.

States, S = L+2: ``embed``, ``block_1`` … ``block_L``, ``final_ln``. HF's
``output_hidden_states`` gives L+1 (its last is final_ln; raw block_L is lost), so a forward
hook on the last layer recovers block_L and the peer does the same work as isojax.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time

import numpy as np
import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

try:
    from bench.common import PYTHIA_SHAPES, flops_per_token, random_sentences, sentence_lengths
except ImportError:  # run as `python -m bench.peer_hf`
    from bench.common import PYTHIA_SHAPES, flops_per_token, random_sentences, sentence_lengths

# Sized so the whole benchmark (3 shapes × 2 batchings × gram on/off) fits in ~3 GPU-minutes
# (~100 s wall on one H200, model builds included).
DEFAULT_TOKENS = {"pythia-70m": 2_000_000, "pythia-410m": 1_000_000, "pythia-1.4b": 500_000, "pythia-6.9b": 300_000,
                  "pythia-12b": 200_000, "gpt-neox-20b": 150_000}


def state_names(n_layers: int) -> list[str]:
    return ["embed"] + [f"block_{i}" for i in range(1, n_layers + 1)] + ["final_ln"]


def build_model(shape, *, device="cuda", dtype=torch.bfloat16, seed=0) -> torch.nn.Module:
    """Random-weight Pythia-shaped GPT-NeoX base model (no LM head), eval mode."""
    d, n_layers, heads, vocab, ff = shape
    config = GPTNeoXConfig(
        vocab_size=vocab, hidden_size=d, num_hidden_layers=n_layers, num_attention_heads=heads,
        intermediate_size=ff, hidden_act="gelu", rotary_pct=0.25, rotary_emb_base=10000,
        max_position_embeddings=2048, layer_norm_eps=1e-5, use_parallel_residual=True,
        tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False,
    )
    torch.manual_seed(seed)
    with torch.device(device):  # initialise on the device: CPU init of 1.4b takes tens of s
        lm = GPTNeoXForCausalLM(config)
    return lm.gpt_neox.to(dtype).eval()


def build_family_model(hf_config: dict, *, device="cuda", dtype=torch.bfloat16, seed=0) -> torch.nn.Module:
    """The transformers base model (AutoModel: no LM head) of any family from a Hugging Face
    config.json dict (isojax's presets are such files), random weights, SDPA attention, eval mode.
    Only transformers' own classes: no remote code."""
    raw = {k: v for k, v in hf_config.items() if k not in ("hub_id", "_comment", "auto_map")}
    config = transformers.AutoConfig.for_model(raw.pop("model_type", "gpt_neox"), **raw)
    config.use_cache = False
    torch.manual_seed(seed)
    with torch.device(device):  # initialise on the device: CPU init of 1.4b takes tens of s
        model = transformers.AutoModel.from_config(config, attn_implementation="sdpa")
    return model.to(dtype).eval()


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The blocks of a transformers base model: `.layers` (GPT-NeoX, the Llama family), `.h` (GPT-2,
    Falcon) or `.decoder.layers` (OPT)."""
    for path in ("layers", "h", "decoder.layers"):
        found = model
        for attr in path.split("."):
            found = getattr(found, attr, None)
        if isinstance(found, torch.nn.ModuleList):
            return found
    raise ValueError(f"{type(model).__name__}: no layer list found")


@dataclasses.dataclass
class PeerStats:
    """Accumulators over all real tokens; S states, vocabulary V, width d."""

    unit_sum_Sxd: torch.Tensor       # Σ û, float32
    norm_sum_S: torch.Tensor         # Σ ‖x‖, float32
    token_sum_SxVxd: torch.Tensor    # Σ û per token id, float32
    token_count_V: torch.Tensor      # int64
    x_sum_Sxd: torch.Tensor | None   # Σ x (gram only)
    gram_Sxdxd: torch.Tensor | None  # Σ x xᵀ (gram only)
    count: int = 0

    @classmethod
    def zeros(cls, n_states, vocab, d, *, gram, device):
        f32 = dict(dtype=torch.float32, device=device)
        return cls(
            torch.zeros(n_states, d, **f32), torch.zeros(n_states, **f32),
            torch.zeros(n_states, vocab, d, **f32),
            torch.zeros(vocab, dtype=torch.int64, device=device),
            torch.zeros(n_states, d, **f32) if gram else None,
            torch.zeros(n_states, d, d, **f32) if gram else None,
        )

    def update(self, states, sel_N, ids_N):
        """states: S tensors [B, T, d]; sel_N: flat indices of real tokens in B*T; ids_N: their ids."""
        for s, h_BxTxd in enumerate(states):
            x_Nxd = h_BxTxd.reshape(-1, h_BxTxd.shape[-1]).index_select(0, sel_N).float()
            norm_Nx1 = torch.linalg.vector_norm(x_Nxd, dim=-1, keepdim=True)
            u_Nxd = x_Nxd / norm_Nx1.clamp_min(1e-30)
            self.unit_sum_Sxd[s] += u_Nxd.sum(0)
            self.norm_sum_S[s] += norm_Nx1.sum()
            self.token_sum_SxVxd[s].index_add_(0, ids_N, u_Nxd)
            if self.gram_Sxdxd is not None:
                self.x_sum_Sxd[s] += x_Nxd.sum(0)
                self.gram_Sxdxd[s].addmm_(x_Nxd.T, x_Nxd)
        self.token_count_V.index_add_(0, ids_N, torch.ones_like(ids_N))  # bincount would sync
        self.count += int(sel_N.shape[0])


def make_batches(lengths, batch_tokens, sort_by_length, seed=0, pad_multiple=1) -> list[np.ndarray]:
    """Sentence indices per batch, rows × padded longest ≤ batch_tokens (a longer sentence goes alone)."""
    order = np.argsort(lengths, kind="stable") if sort_by_length else np.arange(len(lengths))
    padded = -(-np.asarray(lengths, np.int64) // pad_multiple) * pad_multiple
    batches, start, longest = [], 0, 0
    for j, i in enumerate(order):
        longest_if = max(longest, int(padded[i]))
        if j > start and (j - start + 1) * longest_if > batch_tokens:
            batches.append(order[start:j])
            start, longest_if = j, int(padded[i])
        longest = longest_if
    if len(order) > start:
        batches.append(order[start:])
    if sort_by_length:
        np.random.default_rng(seed).shuffle(batches)
    return batches


def _host_batch(tokens, offsets, rows, pin, pad_multiple=1):
    """Right-padded ids and mask [B, T], and flat positions [N] of the real tokens."""
    lens = (offsets[rows + 1] - offsets[rows]).astype(np.int64)
    B, T = len(rows), -(-int(lens.max()) // pad_multiple) * pad_multiple
    ids = np.zeros((B, T), np.int64)
    mask = np.arange(T)[None, :] < lens[:, None]
    ids[mask] = np.concatenate([tokens[offsets[r]:offsets[r + 1]] for r in rows])
    sel = np.flatnonzero(mask.reshape(-1))
    out = [torch.from_numpy(a) for a in (ids, mask.astype(np.int64), sel)]
    return [t.pin_memory() for t in out] if pin else out


def run_peer(
    shape_name, tokens_flat, offsets, *, device="cuda", dtype=torch.bfloat16,
    batch_tokens=16384, sort_by_length=True, pad_multiple=1, warmup_batches=3, max_seconds=None,
    gram=True, gram_tf32=False, sdpa_cudnn=False, model=None, seed=0, finalize=False, keep_stats=False,
    flops=None,
) -> dict:
    """Run the peer over a corpus (flat int32 tokens + int64 offsets); return rate and memory.

    ``shape_name``: a key of PYTHIA_SHAPES or a (d, L, heads, vocab, ff) tuple, or None with
    ``model`` a base model of any family (build_family_model; width, layers and vocabulary from
    it). ``model``: a prebuilt base model (reused across runs; else one is built). ``flops``:
    forward FLOPs per token for the rate (default: the Pythia shape's; nan without a shape). Warm-up batches are
    accumulated but not timed; ``tokens`` counts real (unpadded) tokens of timed batches.
    ``gram_tf32`` lets the float32 Gram matmul use TF32 tensor cores (10-bit mantissa); by
    default it is IEEE float32, which runs on CUDA cores (~40% of pythia-1.4b's time on H100).
    ``pad_multiple`` rounds each batch's T up (HF collators' ``pad_to_multiple_of``).
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    if shape_name is None:
        if model is None:
            raise ValueError("run_peer needs a shape or a model")
        shape = None
        d, n_layers, vocab = model.config.hidden_size, len(decoder_layers(model)), model.config.vocab_size
    else:
        shape = PYTHIA_SHAPES[shape_name] if isinstance(shape_name, str) else tuple(shape_name)
        d, n_layers, _, vocab, _ = shape
    if model is None:
        model = build_model(shape, device=device, dtype=dtype, seed=seed)
    offsets = np.asarray(offsets, np.int64)
    lengths = np.diff(offsets)
    if lengths.min() < 1 or lengths.max() > model.config.max_position_embeddings:
        raise ValueError("sentence lengths must lie in [1, max_position_embeddings]")
    batches = [_host_batch(tokens_flat, offsets, rows, cuda, pad_multiple)
               for rows in make_batches(lengths, batch_tokens, sort_by_length, seed, pad_multiple)]
    warmup = min(warmup_batches, len(batches) - 1)

    captured = {}
    last_block = decoder_layers(model)[-1]
    hook = last_block.register_forward_hook(
        lambda mod, args, out: captured.__setitem__("raw", out[0] if isinstance(out, tuple) else out))
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    stats = PeerStats.zeros(n_layers + 2, vocab, d, gram=gram, device=device)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if gram_tf32 else "highest")
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    if sdpa_cudnn:
        backends.insert(0, SDPBackend.CUDNN_ATTENTION)

    timed_tokens = timed_padded = timed_batches = 0
    t0 = None
    try:
        with torch.inference_mode(), sdpa_kernel(backends):
            for b, (ids_cpu, mask_cpu, sel_cpu) in enumerate(batches):
                if b == warmup:
                    if cuda:
                        torch.cuda.synchronize(device)
                    t0 = time.perf_counter()
                ids_BxT = ids_cpu.to(device, non_blocking=True)
                mask_BxT = mask_cpu.to(device, non_blocking=True)
                sel_N = sel_cpu.to(device, non_blocking=True)
                out = model(input_ids=ids_BxT, attention_mask=mask_BxT,
                            output_hidden_states=True, use_cache=False)
                hs = out.hidden_states
                assert len(hs) == n_layers + 1, len(hs)
                states = list(hs[:-1]) + [captured.pop("raw"), hs[-1]]
                stats.update(states, sel_N, ids_BxT.view(-1).index_select(0, sel_N))
                del out, hs, states
                if b >= warmup:
                    timed_tokens += int(sel_cpu.shape[0])
                    timed_padded += ids_cpu.numel()
                    timed_batches += 1
                    if max_seconds is not None:
                        if cuda:
                            torch.cuda.synchronize(device)
                        if time.perf_counter() - t0 >= max_seconds:
                            break
        if cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
    finally:
        hook.remove()
        torch.set_float32_matmul_precision(precision)

    rate = timed_tokens / seconds if seconds > 0 else math.nan
    fpt = flops if flops is not None else flops_per_token(shape, gram=gram) if shape is not None else math.nan
    result = dict(
        shape=shape_name if isinstance(shape_name, str) else list(shape) if shape is not None
        else model.config.model_type,
        batching="length-sorted" if sort_by_length else "padded", gram=gram, gram_tf32=gram_tf32,
        sdpa_cudnn=sdpa_cudnn, pad_multiple=pad_multiple,
        tokens_per_s=rate, tokens=timed_tokens, seconds=seconds,
        padding_fraction=1 - timed_tokens / max(timed_padded, 1),
        peak_mem_bytes=torch.cuda.max_memory_allocated(device) if cuda else None,
        tokens_processed=stats.count, batches=len(batches), timed_batches=timed_batches,
        warmup_batches=warmup, batch_tokens=batch_tokens, states=n_layers + 2,
        flops_per_token=fpt, tflops=rate * fpt / 1e12, dtype=str(dtype).removeprefix("torch."),
        device=torch.cuda.get_device_name(device) if cuda else "cpu",
        torch=torch.__version__, transformers=transformers.__version__,
    )
    if finalize:
        result["metrics"] = finalize_peer(stats, names=state_names(n_layers))
    if keep_stats:
        result["stats"] = stats
    return result


def finalize_peer(stats: PeerStats, names=None) -> dict:
    """InterSim, IntraSim (unweighted / count-weighted), mean norm and anisotropy per state.

    Everything past the float32 accumulators is float64: per-token ‖Σû‖² are reduced in
    float64 on the accumulators' device (a [V, d] transfer per state is what we avoid), the
    rest on the host; eigenvalues in float64 on the device.
    """
    n = stats.count
    S = stats.unit_sum_Sxd.shape[0]
    names = names or [f"state_{s}" for s in range(S)]
    c_V = stats.token_count_V.cpu().numpy().astype(np.float64)
    seen = c_V >= 2
    c = c_V[seen]
    unit_sum = stats.unit_sum_Sxd.double().cpu().numpy()
    norm_sum = stats.norm_sum_S.double().cpu().numpy()
    layers = []
    for s in range(S):
        sq_V = torch.linalg.vector_norm(stats.token_sum_SxVxd[s], dim=-1, dtype=torch.float64) ** 2
        intra = (sq_V.cpu().numpy()[seen] - c) / (c * c - c)
        row = dict(
            name=names[s], count=n,
            inter_sim=float((unit_sum[s] @ unit_sum[s] - n) / (n * n - n)),
            intra_sim=float(intra.mean()) if len(c) else math.nan,
            intra_sim_weighted=float((intra * c).sum() / c.sum()) if len(c) else math.nan,
            intra_tokens=int(seen.sum()), mean_norm=float(norm_sum[s] / n),
        )
        if stats.gram_Sxdxd is not None:
            mu_d = stats.x_sum_Sxd[s].double() / n
            second_dxd = stats.gram_Sxdxd[s].double() / n
            for key, m_dxd in (("anisotropy", second_dxd - torch.outer(mu_d, mu_d)),
                               ("anisotropy_uncentered", second_dxd)):
                ev = torch.linalg.eigvalsh(m_dxd)
                row[key] = float(ev[-1] / ev.sum())
        layers.append(row)
    return {"tokens": n, "intra_tokens": int(seen.sum()), "layers": layers}


def _table(rows) -> str:
    head = f"{'shape':<12} {'batching':<14} {'gram':<5} {'tokens':>9} {'tok/s':>11} {'TFLOP/s':>8} {'padding':>8} {'peak GiB':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        mem = "-" if r["peak_mem_bytes"] is None else f"{r['peak_mem_bytes'] / 2**30:.2f}"
        lines.append(f"{str(r['shape']):<12} {r['batching']:<14} {'on' if r['gram'] else 'off':<5} "
                     f"{r['tokens']:>9} {r['tokens_per_s']:>11,.0f} {r['tflops']:>8.1f} "
                     f"{r['padding_fraction']:>8.1%} {mem:>9}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description="HF PyTorch peer throughput (issue 7)")
    p.add_argument("--shapes", nargs="+", default=list(PYTHIA_SHAPES), choices=list(PYTHIA_SHAPES))
    p.add_argument("--tokens", type=int, default=None, help="tokens per shape (default: DEFAULT_TOKENS)")
    p.add_argument("--batching", nargs="+", default=["padded", "sorted"], choices=["padded", "sorted"])
    p.add_argument("--gram", choices=["on", "off", "both"], default="both")
    p.add_argument("--gram-tf32", action="store_true")
    p.add_argument("--sdpa-cudnn", action="store_true", help="let SDPA use cuDNN attention")
    p.add_argument("--pad-multiple", type=int, default=1)
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--warmup-batches", type=int, default=3)
    p.add_argument("--max-seconds", type=float, default=15.0, help="per run; <= 0 for none")
    p.add_argument("--prime-seconds", type=float, default=3.0,
                   help="untimed padded run per shape first, to grow the allocator and meet shapes")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write all rows to this file")
    a = p.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    grams = {"on": [True], "off": [False], "both": [False, True]}[a.gram]
    rows = []
    for name in a.shapes:
        shape = PYTHIA_SHAPES[name]
        lengths = sentence_lengths(a.tokens or DEFAULT_TOKENS[name], seed=a.seed)
        tokens, offsets = random_sentences(lengths, shape[3], seed=a.seed)
        model = build_model(shape, device=a.device, dtype=dtype, seed=a.seed)
        common = dict(device=a.device, dtype=dtype, model=model, batch_tokens=a.batch_tokens,
                      sdpa_cudnn=a.sdpa_cudnn, pad_multiple=a.pad_multiple, seed=a.seed)
        if a.prime_seconds > 0:  # else the first run of a shape pays one-time costs (~10% at 70m)
            run_peer(name, tokens, offsets, sort_by_length=False, max_seconds=a.prime_seconds, **common)
        for batching in a.batching:
            for gram in grams:
                r = run_peer(name, tokens, offsets, sort_by_length=batching == "sorted",
                             warmup_batches=a.warmup_batches, gram=gram, gram_tf32=a.gram_tf32,
                             max_seconds=a.max_seconds if a.max_seconds > 0 else None, **common)
                rows.append(r)
                print(_table([r]).splitlines()[-1], flush=True)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    r0 = rows[0]
    print(f"\n{r0['device']}, torch {r0['torch']}, transformers {r0['transformers']}, {r0['dtype']}, "
          f"SDPA{' +cuDNN' if a.sdpa_cudnn else ''}, batch_tokens {a.batch_tokens}, "
          f"pad_multiple {a.pad_multiple}, Gram TF32 {a.gram_tf32}")
    print(_table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
