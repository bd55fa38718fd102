"""Train the demo EAGLE-3 heads for SmolLM2-135M-Instruct: ``calibrate.training.eagle3`` (usage, options)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's package, installed or not
from calibrate.training.eagle3 import main  # noqa: E402

if __name__ == "__main__":
    main()
