"""Markdown tables of ``sharpdraft bench --out`` results: ``calibrate.bench_tables`` (usage, columns)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's package, installed or not
from calibrate.bench_tables import main  # noqa: E402

if __name__ == "__main__":
    main()
