"""``python -m deepfreeze.cli``: the ``deepfreeze`` command."""
import sys

from .app import main

sys.exit(main())
