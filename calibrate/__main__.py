"""``python -m calibrate``: the ``sharpdraft`` command line, for a checkout without the console script."""

from .cli import main

main()
