"""Train a DFlash head for SmolLM2-135M-Instruct: ``calibrate.training.dflash`` (usage, options)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's package, installed or not
from calibrate.training.dflash import main  # noqa: E402

if __name__ == "__main__":
    main()
