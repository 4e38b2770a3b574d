"""``python -m deepfreeze.cli``: the ``deepfreeze`` command."""
import sys

from . import main

sys.exit(main())
