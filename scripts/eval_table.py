"""Markdown tables of a ``sharpdraft eval --out`` result: ``calibrate.eval.tables`` (usage, options)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's package, installed or not
from calibrate.eval.tables import main  # noqa: E402

if __name__ == "__main__":
    main()
