"""One measurement engine for ``sharpdraft eval``, its ``--slopes`` oracle and ``calibrate --select``.

* :mod:`.metrics`: per-row greedy agreement and the expected acceptance of speculative sampling,
  ``sum_x min(p_T(x), q_T(x))``;
* :mod:`.forced`: the teacher-forced many-arm pass (one target pass per sequence serves every arm)
  reduced to per-bucket tallies, and the summaries with paired intervals over sequences;
* :mod:`.arms`: the arms a user can ask for (variants, scale grids, position fixes);
* :mod:`.saved`: finished units kept for ``--resume``.
"""

from .arms import alpha_arm, parse_grid, scale_grid, slope_arm
from .forced import DRAFTS, METRICS, SUBSETS, TARGET, Arm, MassMeter, Tally, gain, summarize, tally_sequence
from .metrics import NextTokenLaw, expected_acceptance
from .saved import SavedUnits, partial_dir

__all__ = ["alpha_arm", "parse_grid", "scale_grid", "slope_arm", "METRICS", "DRAFTS", "SUBSETS", "TARGET", "Arm", "MassMeter", "Tally", "gain", "summarize", "tally_sequence", "NextTokenLaw",
           "expected_acceptance", "SavedUnits", "partial_dir"]
