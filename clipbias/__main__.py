"""``python -m clipbias``: the command line, so that ``torchrun --standalone --nproc-per-node N -m
clipbias train ...`` launches distributed training (docs/cli.md, "Several processes")."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
