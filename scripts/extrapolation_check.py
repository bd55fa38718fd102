"""The distance model's extrapolation on text it was not fitted on: ``calibrate.extrapolation`` (usage, options)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's package, installed or not
from calibrate.extrapolation import main  # noqa: E402

if __name__ == "__main__":
    main()
