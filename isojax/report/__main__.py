"""python -m isojax.report RESULTS... --out DIR"""

import sys

from isojax.report.build import main

if __name__ == "__main__":
    sys.exit(main())
