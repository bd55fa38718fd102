"""How often a SmolLM2 cut, untrained, agrees with SmolLM2: ``calibrate.training.pard_cut`` (usage, options)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's package, installed or not
from calibrate.training.pard_cut import main  # noqa: E402

if __name__ == "__main__":
    main()
