import sys

from isojax.weights.command import main

sys.exit(main())
