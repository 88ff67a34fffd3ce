"""python -m converters SRC --out DIR: a Hugging Face GPT-NeoX checkpoint (local directory, preset
name or hub id, with --revision) -> an isojax Orbax checkpoint that `isojax.load_model(DIR)` loads."""

from __future__ import annotations

import sys
from pathlib import Path

from isojax.errors import ArgumentParser, UserError, run_command


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m converters", description=__doc__)
    ap.add_argument("src", help="Hugging Face checkpoint directory, preset (pythia-1.4b), or hub id (org/name)")
    ap.add_argument("--out", required=True, help="directory to write (must not exist unless --overwrite)")
    ap.add_argument("--revision", default=None, help="hub revision, e.g. step143000 (hub sources only)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return run_command(convert, ap.parse_args(argv))


def convert(args) -> None:
    from isojax.hf.family.presets import base_preset, hub_id
    from isojax.hf.files import resolve_checkpoint
    from isojax.hf.orbax_io import convert_dir
    from isojax.run.outdir import refuse_earlier
    out = Path(args.out)
    refuse_earlier(out, out.exists(), overwrite=args.overwrite)  # before anything is downloaded
    src = Path(args.src).expanduser()
    if src.is_dir():
        if args.revision:
            raise UserError("--revision applies to hub models, not to a local directory")
        source = {"name": str(src), "revision": None}
    else:
        repo = hub_id(args.src) if base_preset(args.src) else args.src
        src = resolve_checkpoint(repo, args.revision)
        source = {"name": repo, "revision": args.revision}
    out = convert_dir(src, out, source=source)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
