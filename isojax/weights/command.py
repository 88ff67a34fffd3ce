"""Isotropy of a checkpoint's weights: `python -m isojax.weights --model pythia-70m --out DIR`.

For checkpoints of the families in `isojax.weights.families` (config.json's model_type): I(W)
and friends of the embedding (`embed_in`) and unembedding (`embed_out`; tied ones measured once)
matrices and the final norm's g and b (Machina & Mercer §4.2-4.4);
`random:<preset>` measures the random weights `isojax.load_model` gives that name, offline.
With `--tensor NAME`: the matrix metrics of any 2-D tensor of any checkpoint; with
`--matrix PATH[:KEY]`: of a matrix in any file (`isojax.weights.matrix_files`).
Results are committed whole (isojax.run.outdir), so a failed run never damages earlier results;
`--revisions`/`--paper-steps` sweep into OUT/<model>/<revision>/ as extract does (isojax.run.sweep).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import pathlib
import re
import sys

import numpy as np

from isojax.log import log
from isojax.hf import files as hf_files
from isojax.weights import families
from isojax.weights import isotropy
from isojax.weights import matrix_files
from isojax.weights.random_weights import RandomWeights
from isojax import storage
from isojax.run import outdir
from isojax.run.names import checkpoint_name
from isojax.plots import weights as weight_plots
from isojax.errors import ArgumentParser, UserError, run_command
from isojax.steps import RANDOM, checkpoint_weights, local_revision, paper_steps

MATRIX_METRICS = ["isotropy", "isotropy_one_sided", "isotropy_centered", "isotropy_pc_removed",
                  "isotropy_scaled_centered", "mean_norm", "mean_vector_norm"]
LN_METRICS = [("avgnorm_g", "avgnorm_b"), ("b_over_g",), ("gao_sum",),
              ("b_parallel_norm", "b_perp_norm")]


def _matrix(reader, name: str):
    shape = reader.shape(name)
    if len(shape) != 2 or 0 in shape:
        raise UserError(f"tensor {name!r} has shape {tuple(shape)}: the matrix metrics need a "
                        "non-empty 2-D tensor")
    return reader.rows(name)


def _safe(name: str) -> str:
    return re.sub(r"[^\w.\-]+", "_", name)


def _unique_safe(names: list[str]) -> list[str]:
    """File-name-safe keys for names, one per name, all distinct."""
    out: list[str] = []
    for n in names:
        k = base = _safe(n)
        i = 1
        while k in out:
            i += 1
            k = f"{base}_{i}"
        out.append(k)
    return out


def model_label(model: str, revision: str | None = None) -> str:
    """How plots name a model: 'pythia-70m @ step1000', 'pythia-70m — RANDOM WEIGHTS',
    'EleutherAI/pythia-70m @ 0123abcd' for a Hugging Face cache snapshot, or the path."""
    if model.startswith("random:"):
        return f"{model.removeprefix('random:')} — RANDOM WEIGHTS"
    path = pathlib.Path(model).expanduser()
    if path.is_dir():
        m = re.search(r"models--([^/]+)--([^/]+)/snapshots/([0-9a-f]+)", str(path.resolve()))
        if m:
            return f"{m[1]}/{m[2]} @ {m[3][:8]}"
        return _short_path(model)
    return model + (f" @ {revision}" if revision else "")


def _short_path(p: str) -> str:
    parts = pathlib.PurePath(p).parts
    return p if len(p) <= 48 or len(parts) <= 2 else "…/" + "/".join(parts[-2:])


def _measure(W, where: str, key: str, title: tuple[str, str], arrays: dict, out: pathlib.Path,
             plots: bool) -> dict:
    """Matrix metrics of W (reported as `where` on bad values); arrays and PNGs under `key`."""
    try:
        rep = isotropy.analyze_matrix(W)
    except ValueError as exc:
        row = _first_nonfinite_row(W)
        if row is not None:
            exc = f"the matrix holds NaN or infinite values (the first in row {row})"
        raise UserError(f"{where}: {exc}") from None
    if any(isinstance(v, float) and not math.isfinite(v) for v in rep.metrics.values()):
        raise UserError(f"{where}: the matrix holds values too large for its metrics")
    arrays.update({f"{key}/singular_values": rep.singular_values,
                   f"{key}/singular_values_centered": rep.singular_values_centered,
                   f"{key}/proj2d": rep.proj2d, f"{key}/proj2d_centered": rep.proj2d_centered})
    if plots:
        weight_plots.matrix_plots(rep, key, out, *title)
    return dict(rep.metrics)


def _first_nonfinite_row(W, step: int = 4096) -> int | None:
    """The first row of a 2-D array or `RowBlocks` holding NaN or inf (read a block at a time); None: none."""
    for i in range(0, W.shape[0] if len(getattr(W, "shape", ())) == 2 else 0, step):
        bad = ~np.isfinite(np.asarray(W[i:i + step])).all(axis=1)
        if bad.any():
            return i + int(np.argmax(bad))
    return None


def _same(reader, a: str, b: str) -> bool:
    """Whether two stored tensors are equal, compared a block of rows at a time."""
    if reader.shape(a) != reader.shape(b):
        return False
    A, B, step = reader.rows(a), reader.rows(b), 4096
    return all(np.array_equal(A[i:i + step], B[i:i + step]) for i in range(0, reader.shape(a)[0], step))


def _final_norm(reader, t: families.Tensors, source) -> dict:
    """`final_ln`: the norm's kind and tensors, and its statistics (null where it has no such weight)."""
    head = {"norm": t.norm, "tensor_g": t.norm_g, "tensor_b": t.norm_b}
    if t.norm_g is None:
        return {**head, **dict.fromkeys(isotropy.NORM_KEYS)}
    g = reader.read(t.norm_g) + t.norm_offset
    b = None if t.norm_b is None else reader.read(t.norm_b)
    if g.ndim != 1 or g.size == 0 or b is not None and g.shape != b.shape:
        shapes = f"weight {g.shape}" + ("" if b is None else f" and bias {b.shape}")
        raise UserError(f"final norm {shapes} in {source}: not " + ("a vector" if b is None else
                        "two vectors of one length"))
    if not all(np.all(np.isfinite(v)) for v in (g, b) if v is not None):
        raise UserError(f"final norm in {source} holds NaN or infinite values")
    return {**head, **isotropy.layer_norm_metrics(g, b)}


def _write(out: pathlib.Path, result: dict, arrays: dict) -> None:
    np.savez(out / "arrays.npz", **{_safe(k): v for k, v in arrays.items()})
    (out / "weights.json").write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")


def analyze_checkpoint(model: str, revision: str | None, tensors: list[str] | None,
                       out: pathlib.Path, plots: bool = True, name: tuple | None = None) -> dict:
    """Measure one checkpoint, write `out/weights.json` (+ arrays.npz, PNGs); return the JSON.
    name: (model, revision) as the results name it (default: isojax.run.names.checkpoint_name)."""
    named, named_revision = name or checkpoint_name(model, revision)
    if model.startswith("random:"):
        reader, directory = RandomWeights(model.removeprefix("random:"), only=tensors), None
        config = {"model_type": "gpt_neox", "tie_word_embeddings": False}
        result: dict = {"model": named, "revision": None, "weights": RANDOM, "checkpoint": None}
    else:
        directory = local_revision(model, revision) or \
            hf_files.resolve_weights(model, revision, tensors=tensors or families.all_names())
        reader = hf_files.CheckpointReader(directory, only=tensors or families.all_names())
        config = None if tensors else families.read_config(directory)
        result = {"model": named, "revision": named_revision, "weights": checkpoint_weights(named_revision, directory),
                  "checkpoint": str(directory)}
    result["format"] = reader.format
    source = f"random weights of {model.removeprefix('random:')}" if directory is None else directory
    if tensors:
        matrices, tied = {t: t for t in tensors}, False
        result["tensors"] = {}
    else:
        t = families.locate(config, reader.names(), source)
        tied = t.tied and (t.unembed is None or _same(reader, t.embed, t.unembed))
        if t.tied and not tied:
            log(f"warning: config.json ties the embeddings but {source} stores a different {t.unembed}: "
                "measured as two matrices, as transformers uses them")
        result.update(family=t.family, tied=tied)
        matrices = {"embed_in": t.embed} if tied else {"embed_in": t.embed, "embed_out": t.unembed}
    arrays: dict = {}
    label = model_label(model, revision)
    for (key, name), safe in zip(matrices.items(), _unique_safe(list(matrices))):
        sub = "embed_in = embed_out (tied)" if tied else key
        m = _measure(_matrix(reader, name), f"tensor {name!r} in {source}", safe, (label, sub),
                     arrays, out, plots)
        m.update(tensor=name, dtype=reader.dtype(name))
        (result["tensors"] if tensors else result)[key] = m
    if not tensors:
        if tied:
            result["embed_out"] = {"tied_to": "embed_in", "tensor": t.embed}
        result["final_ln"] = _final_norm(reader, t, source)
    _write(out, result, arrays)
    return result


def _matrix_key(path: pathlib.Path, key: str | None) -> str:
    """How a --matrix names its plots and arrays: the file name without its extension (and .gz),
    then _KEY: glove.6B.50d.txt -> glove.6B.50d, emb.safetensors:embed.weight -> emb_embed.weight."""
    name = path.name.removesuffix(".gz")
    stem = name.rsplit(".", 1)[0] if "." in name.lstrip(".") else name
    return stem + (f"_{key}" if key is not None else "")


def analyze_matrices(specs: list[str], out: pathlib.Path, plots: bool = True) -> dict:
    """Measure matrices from files (`PATH[:KEY]`, `isojax.weights.matrix_files`); write and return the
    JSON `{"tensors": {spec: M}}`."""
    result: dict = {"tensors": {}}
    arrays: dict = {}
    files = [matrix_files.read_matrix(s) for s in specs]  # every input checked before the work
    keys = _unique_safe([_matrix_key(f.path, f.key) for f in files])
    for f, key in zip(files, keys):
        where = f"{f.path}" + (f" [{f.key}]" if f.key is not None else "")
        m = _measure(f.matrix, where, key, (_short_path(f.spec), ""), arrays, out, plots)
        m.update(file=str(f.path), key=f.key, format=f.format, dtype=f.dtype)
        result["tensors"][f.spec] = m
    _write(out, result, arrays)
    return result


def _flat(result: dict) -> dict:
    """Scalar metrics as `group.metric` columns for the sweep table."""
    row = {}
    groups = result.get("tensors") or {k: result[k] for k in ("embed_in", "embed_out", "final_ln")}
    for g, metrics in groups.items():
        for k, v in metrics.items():
            if isinstance(v, (int, float)) or v is None:
                row[f"{g}.{k}"] = v
    return row


def _check_sources(args) -> None:
    """Exactly one of --model and --matrix; --matrix with nothing but --out/--overwrite/--no-plots."""
    if args.matrix:
        extra = [flag for flag, given in (("--model", args.model), ("--revision", args.revision),
                                          ("--revisions", args.revisions),
                                          ("--paper-steps", args.paper_steps),
                                          ("--tensor", args.tensor)) if given]
        if extra:
            raise UserError(f"--matrix takes no {extra[0]} (it combines only with --out, "
                            "--overwrite and --no-plots)")
        dup = next((m for i, m in enumerate(args.matrix) if m in args.matrix[:i]), None)
        if dup is not None:
            raise UserError(f"--matrix {dup} is given twice")
        if not all(args.matrix):
            raise UserError("--matrix needs PATH[:KEY]")
    elif not args.model:
        raise UserError("give --model NAME_OR_PATH, or --matrix PATH[:KEY] for matrices in files")
    elif args.model.startswith("random:") and (args.revision or args.revisions or args.paper_steps):
        raise UserError(f"{args.model} has no revisions: random weights are made, not downloaded")
    sweep = args.revisions or args.paper_steps
    for flag, given in (("--resume", args.resume), ("--delete-downloads", args.delete_downloads),
                        ("--shard", args.shard)):
        if given and not sweep:
            raise UserError(f"{flag} applies to sweeps (--revisions, --paper-steps)")
    if args.shard:
        from isojax.run.sweep import parse_shard
        parse_shard(args.shard, True)


def run(args) -> None:
    storage.local_only(args, "weights")
    _check_sources(args)
    out = pathlib.Path(args.out)
    # inputs: --model's folder, --matrix files (PATH or PATH:KEY; paths that do not exist are skipped)
    inputs = [args.model or "", *(args.matrix or []), *(m.rpartition(":")[0] for m in args.matrix or [])]
    outdir.check_path(out, inputs)
    if args.paper_steps:
        revisions = paper_steps()
    elif args.revisions:
        revisions = [r.strip() for r in args.revisions.split(",") if r.strip()]
        if not revisions:
            raise UserError("--revisions is empty")
    else:
        revisions = None
    if args.revision:
        local_revision(args.model, args.revision)  # a local folder of revisions: refused unless it has this one
    if args.tensor and not all(args.tensor):
        raise UserError("--tensor needs a tensor name")
    if revisions is not None:
        _sweep(args, revisions, out, inputs)
        _summary(out, revisions, args.shard)
        return
    names = {"weights.json", "arrays.npz"}
    with outdir.claim(out, overwrite=args.overwrite, names=names, inputs=inputs), outdir.staged(out) as tmp:
        if args.matrix:
            analyze_matrices(args.matrix, tmp, not args.no_plots)
        else:
            analyze_checkpoint(args.model, args.revision, args.tensor, tmp, not args.no_plots)
    _summary(out, revisions)


def _summary(out: pathlib.Path, revisions: list[str] | None, shard: str | None = None) -> None:
    """The one line a successful run ends with: what was measured, I(W), where the results are."""
    pngs = len(list(out.glob("*.png")))
    if revisions is not None:
        log(f"{len(revisions)} revisions{f' (shard {shard})' if shard else ' measured'}; results in "
            f"{out}/<model>/<revision>/ and {out}/sweep.csv" + (f", {pngs} sweep plots" if pngs else ""))
        return
    doc = json.loads((out / "weights.json").read_text())
    groups = doc.get("tensors") or {k + (" (tied)" if doc.get("tied") else ""): doc[k]
                                    for k in ("embed_in", "embed_out") if "isotropy" in doc[k]}
    iso = [f"{name} {m['isotropy']:.4g}" for name, m in groups.items()]
    more = f" and {len(iso) - 3} more" if len(iso) > 3 else ""
    log(f"I(W) of {', '.join(iso[:3])}{more}; results in {out} (weights.json, arrays.npz"
          + (f", {pngs} PNGs)" if pngs else ")"))


def _sweep(args, revisions: list[str], out: pathlib.Path, inputs) -> None:
    """OUT/<model>/<revision>/ per revision (as extract's sweeps; isojax.run.sweep), then OUT/sweep.csv
    and OUT/sweep_*.png over the finished ones."""
    from isojax.run import sweep

    steps = sweep.plan([args.model], revisions, out)  # unknown revisions refused before any is measured
    old = next((out / r for r in revisions if (out / _safe(r) / "weights.json").exists()), None)
    if old is not None:  # the report would find each revision twice
        raise UserError(f"{out} holds a weights sweep of the earlier layout ({old}/, now OUT/<model>/<revision>/); "
                        "sweep into another --out, or move it away")
    needed, plots = args.tensor or families.all_names(), not args.no_plots

    def measure(step: sweep.Step) -> None:
        spec, revision = (str(step.local), None) if step.local is not None else (step.model, step.revision)
        with outdir.staged(step.folder) as tmp:
            analyze_checkpoint(spec, revision, args.tensor, tmp, plots, name=step.name)

    def finish(ready: list[sweep.Step]) -> None:
        rows = sweep.sweep_rows(ready, "weights.json", lambda doc: [_flat(doc)])
        cols = list(dict.fromkeys(k for r in rows for k in r))
        with outdir.staged(out, replace_all=False) as tmp:
            with open(tmp / "sweep.csv", "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=cols)
                w.writeheader()
                w.writerows([{k: "" if r.get(k) is None else r.get(k) for k in cols} for r in rows])
            if plots:
                groups = list(args.tensor) if args.tensor else \
                    [g for g in ("embed_in", "embed_out") if any(f"{g}.isotropy" in r for r in rows)]  # tied: one
                ln = [ms for ms in LN_METRICS if any(r.get(f"final_ln.{m}") is not None for r in rows for m in ms)]
                weight_plots.sweep_plots(rows, groups, MATRIX_METRICS, [] if args.tensor else ln, tmp,  # null: none
                                         model_label(args.model))

    sweep.run_steps(steps, out, result="weights.json", measure=measure,
                    fetch=lambda s: hf_files.resolve_weights(s.repo, s.revision, tensors=needed),
                    resume=args.resume, overwrite=args.overwrite, delete_downloads=args.delete_downloads,
                    finish=finish, inputs=inputs, shard=sweep.parse_shard(args.shard, True))


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(
        prog="python -m isojax.weights",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Partition-function isotropy I(W) of the embedding and unembedding "
                    "matrices and statistics\nof the final norm of a checkpoint of a known family "
                    "(model_type in config.json:\n" + ", ".join(sorted(families.FAMILIES)) +
                    "),\nor of any 2-D tensor with --tensor, or of matrices in files with --matrix.",
        epilog="outputs in OUT (OUT/<model>/<revision>/ per revision for sweeps):\n"
               "  weights.json             metrics (family, tied, embed_in, embed_out, final_ln | tensors)\n"
               "  arrays.npz               normalized singular values, 2-D SVD projections\n"
               "  *_singular_values.png    normalized singular values before/after centering\n"
               "  *_svd2d.png              2-D SVD projection, uncentered and centered\n"
               "  sweep.csv, sweep_*.png   sweeps only: one row per revision, one plot per metric\n"
               "I(W) = min Z(c) / max Z(c) over the eigenvectors c of W^T W and their negations;\n"
               "isotropy_one_sided: one sign per eigenvector, <c, mean row> > 0 (isojax.weights.isotropy).")
    ap.add_argument("--model", metavar="NAME_OR_PATH",
                    help="preset (pythia-70m, pythia-70m-deduped, ...), random:<preset> (random "
                         "weights, offline), hub id (EleutherAI/pythia-70m) or local directory "
                         "in Hugging Face layout")
    rev = ap.add_mutually_exclusive_group()
    rev.add_argument("--revision", help="hub revision (branch, tag or commit), e.g. step143000; of a local "
                                        "directory with one subfolder per revision: that subfolder")
    rev.add_argument("--revisions", metavar="R1,R2,...",
                     help="sweep comma-separated revisions: OUT/<model>/<revision>/ per revision, "
                          "OUT/sweep.csv and OUT/sweep_*.png; a local directory with one subfolder per "
                          "revision stands in for a hub repository")
    rev.add_argument("--paper-steps", action="store_true",
                     help="sweep the paper's 21 checkpoints: step0 and floor(i*143/20)*1000 "
                          "for i = 1..20")
    ap.add_argument("--shard", metavar="I/N",
                    help="sweeps: measure every N-th revision from the I-th (I = 0 ... N-1), so N jobs (a SLURM job "
                         "array: $SLURM_ARRAY_TASK_ID/N) run one sweep into one shared --out; each rebuilds "
                         "OUT/sweep.csv from every finished revision and says how many are still missing")
    ap.add_argument("--out", required=True, metavar="DIR", help="output directory")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace existing results in OUT (refused without it)")
    ap.add_argument("--resume", action="store_true",
                    help="sweeps: skip the revisions already measured in OUT (nothing is downloaded for them)")
    ap.add_argument("--delete-downloads", action="store_true",
                    help="sweeps: once a revision is measured, delete from the Hugging Face cache the files this "
                         "sweep downloaded for it (files cached before the run stay)")
    ap.add_argument("--tensor", action="append", metavar="NAME",
                    help="measure this 2-D tensor instead of the family's set; repeatable; "
                         "works for any safetensors checkpoint (reads only that tensor)")
    ap.add_argument("--matrix", action="append", metavar="PATH[:KEY]",
                    help="measure a 2-D matrix in a file instead of a model; repeatable: .npy, "
                         ".npz:ARRAY, .safetensors:TENSOR, .bin/.pt:KEY (weights_only; nested "
                         "dicts as a.b.c), word vectors .txt/.vec[.gz] (word2vec text or GloVe); "
                         "KEY may be left out when the file holds one matrix")
    ap.add_argument("--no-plots", action="store_true", help="write no PNGs")
    return ap


def main(argv=None) -> int:
    return run_command(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
