"""`python -m isojax.correlate`: correlation of isotropy metrics with downstream scores; the command
lives in isojax.report.correlate, beside the report that uses its correlations."""

import sys

from isojax.report import correlate as _impl
from isojax.report.correlate import main


def __getattr__(name: str):
    return getattr(_impl, name)


if __name__ == "__main__":
    sys.exit(main())
