"""Teacher-forced agreement at every step of EAGLE-3 heads' chains: ``calibrate.training.chain`` (usage, options)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's package, installed or not
from calibrate.training.chain import main  # noqa: E402

if __name__ == "__main__":
    main()
