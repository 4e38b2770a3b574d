"""``python -m deepfreeze``: the ``deepfreeze`` command (:mod:`deepfreeze.cli`)."""
import sys

from .cli.app import main

sys.exit(main())
