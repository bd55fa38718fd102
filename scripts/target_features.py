"""Target features for training EAGLE-3 and DFlash heads: ``calibrate.training.features`` (usage, options)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's package, installed or not
from calibrate.training.features import main  # noqa: E402

if __name__ == "__main__":
    main()
