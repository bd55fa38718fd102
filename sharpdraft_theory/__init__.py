"""SharpDraft theory: attention-mass dilution and cardinality-aware query scaling.

Pure numpy/scipy (no torch). See ``docs/theory.md`` for the derivation.
"""

from .correction import (Correction, exact_alpha, horizon_log_ratio, horizon_n, least_squares_slope, log_ratio,
                         regime, tangent_slope)
from .dilution import annealed_log_odds, annealed_mass, dilution_mass, monte_carlo_mass
from .laws import LAWS, Law, alpha_law, get_law
from .mass import log_sum_exp_top, n_visible, tilted_mean, topk_log_odds, topk_mass
from .models import Empirical, Gaussian, ScoreModel, TwoLevel
from .spec import SCHEMA, AlphaTable, Bucket, Calibration, DrafterInfo, EstimatorResult, ScaleSpec, SpecError

__version__ = "0.1.0"

__all__ = [
    "Correction", "exact_alpha", "horizon_log_ratio", "horizon_n", "least_squares_slope", "log_ratio", "regime",
    "tangent_slope", "annealed_log_odds", "annealed_mass", "dilution_mass", "monte_carlo_mass", "LAWS", "Law",
    "alpha_law", "get_law", "log_sum_exp_top", "n_visible", "tilted_mean", "topk_log_odds", "topk_mass", "Empirical",
    "Gaussian", "ScoreModel", "TwoLevel", "SCHEMA", "AlphaTable", "Bucket", "Calibration", "DrafterInfo",
    "EstimatorResult",
    "ScaleSpec", "SpecError",
]
