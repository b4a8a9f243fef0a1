"""`python -m flexgen`: the same command line as the `flexgen` script (see `flexgen.cli`)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
