"""Train a PARD drafter for SmolLM2-135M-Instruct: ``calibrate.training.pard`` (usage, options)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's package, installed or not
from calibrate.training.pard import main  # noqa: E402

if __name__ == "__main__":
    main()
