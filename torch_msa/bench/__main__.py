"""`python -m torch_msa.bench`: see `torch_msa.bench` and `--help`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
