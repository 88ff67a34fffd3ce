"""The two JSON documents of a run: metrics (DESIGN.md's contract) and the manifest (provenance)."""

from __future__ import annotations

import importlib.metadata
import platform
import sys
import time

import jax

from isojax.run.names import checkpoint_name


def build_metrics(model, unit: str, done: dict, final: dict, has_sources: bool) -> dict:
    name, revision = checkpoint_name(model.source["name"], model.source.get("revision"))
    metrics = {"model": name, "revision": revision, "weights": model.weights,
               "unit": unit, "tokens": done["tokens"], "sequences": done["sequences"],
               "dtype": model.dtype, "layers": final["layers"]}
    if has_sources and "groups" in final:
        metrics["sources"] = final["groups"]
    for name, info in final.get("step_info", {}).items():  # a step measure's block (base.Step.info): the logit
        metrics[name] = info  # lens's K, the tokens measured and their fraction
    if "sentences" in final:  # the sentence probe's subset (stats/sentences.py)
        metrics["sentences"] = final["sentences"]
    return metrics


def package_versions() -> dict:
    names = ["isojax", "jax", "jaxlib", "flax", "orbax-checkpoint", "numpy", "tokenizers", "transformers",
             "datasets", "tensorstore"]
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def build_manifest(model, kernels, cache, corpus, done, plan, seconds, wall, settings) -> dict:
    """The manifest of a run of the LoadedModel `model` with the plan's KernelChoice `kernels`."""
    dev = jax.devices()[0]
    name, revision = checkpoint_name(model.source["name"], model.source.get("revision"))
    return {
        "model": name, "revision": revision, "weights": model.weights,
        "weight_checksum": model.source["checksum"], "model_path": model.source.get("path"),
        "tokenizer": model.source.get("tokenizer"), "config": model.config.to_dict(),
        "corpus": corpus.describe(), "corpus_fingerprint": cache.fingerprint,
        "corpus_options": {"unit": corpus.unit, "sources": sorted(corpus.sources) if corpus.sources else None,
                           "max_tokens": corpus.max_tokens, "max_tokens_per_source": corpus.max_tokens_per_source},
        "corpus_sources": cache.source_counts(), "bad_records_skipped": corpus.bad_records,
        "tokens": done["tokens"], "sequences": done["sequences"], "batches": done["batches"],
        "padding_fraction": plan.padding_fraction, "settings": settings,
        "kernels": {"attention": kernels.attention, "mlp": kernels.mlp, "norm": kernels.norm},
        "kernel_reasons": dict(kernels.reasons),
        "seconds_device_loop": seconds, "seconds_wall": wall,
        "tokens_per_second": done["tokens"] / max(seconds, 1e-9),
        "device": {"platform": dev.platform, "kind": dev.device_kind, "count": settings.get("devices"),
                   "mesh": settings.get("mesh"), "processes": jax.process_count()},
        "host": {"python": sys.version.split()[0], "platform": platform.platform()},
        "versions": package_versions(), "command": sys.argv,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
