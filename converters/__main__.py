"""Deprecated: `python -m converters` is `python -m isojax.convert` (isojax/convert.py)."""

import sys

from isojax.convert import main

if __name__ == "__main__":
    print("warning: python -m converters is deprecated and will be removed; use python -m isojax.convert",
          file=sys.stderr)
    sys.exit(main())
