"""python -m isojax.convert SRC --out DIR: a Hugging Face checkpoint (local directory, preset name or
hub id, with --revision) -> an isojax Orbax checkpoint that `isojax.load_model(DIR)` loads. DIR is a
result folder like every command's --out (isojax.run.outdir): it holds no input and lies in none,
the checkpoint appears in one commit, --overwrite replaces only what isojax wrote there before (its
record), and the user's files there stay."""

from __future__ import annotations

import sys
from pathlib import Path

from isojax.errors import ArgumentParser, UserError, run_command


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m isojax.convert", description=__doc__)
    ap.add_argument("src", help="Hugging Face checkpoint directory, preset (pythia-1.4b), or hub id (org/name)")
    ap.add_argument("--out", required=True, help="folder to write the converted checkpoint into (one that holds "
                    "isojax's results already only with --overwrite)")
    ap.add_argument("--revision", default=None, help="hub revision, e.g. step143000 (hub sources only)")
    ap.add_argument("--overwrite", action="store_true", help="replace a checkpoint isojax converted into --out before")
    return run_command(convert, ap.parse_args(argv))


def convert(args) -> None:
    src = Path(args.src).expanduser()
    if src.is_dir() and args.revision:
        raise UserError("--revision applies to hub models, not to a local directory")
    out = convert_dir(args.src, args.out, revision=args.revision, overwrite=args.overwrite)
    print(f"wrote {out}", file=sys.stderr)


def convert_dir(src, dst, *, revision: str | None = None, overwrite: bool = False) -> Path:
    """Convert `src` (a local Hugging Face folder, a preset or a hub id) into the folder `dst`,
    checked before anything is read or downloaded, committed whole (isojax.run.outdir)."""
    from isojax.hf.family.presets import base_preset, hub_id
    from isojax.hf.files import resolve_checkpoint
    from isojax.hf.orbax_io import CONVERTED_NAMES, write_converted
    from isojax.run import outdir
    dst, local = Path(dst), Path(src).expanduser()
    with outdir.claim(dst, overwrite=overwrite, names=CONVERTED_NAMES, inputs=[local]):
        if local.is_dir():
            folder, source = local, {"name": str(local), "revision": None}
        else:
            repo = hub_id(str(src)) if base_preset(str(src)) else str(src)
            folder, source = resolve_checkpoint(repo, revision), {"name": repo, "revision": revision}
            outdir.check_path(dst, [folder])  # the hub's snapshot is an input too
        with outdir.staged(dst) as stage:
            write_converted(folder, stage, source)
    return dst


if __name__ == "__main__":
    sys.exit(main())
