"""Training text written by the target itself: ``calibrate.training.regenerate`` (usage, options)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's package, installed or not
from calibrate.training.regenerate import main  # noqa: E402

if __name__ == "__main__":
    main()
