"""Figures of attention-mass dilution and its correction: theory against measurement.

Every figure function returns a ``matplotlib.figure.Figure`` drawn on the Agg canvas (no pyplot,
no display needed), so the notebooks, ``sharpdraft plot`` and the tests share one implementation.
The math lives in ``sharpdraft_theory``; these modules only evaluate it and draw.

* ``theory``       the score models: dilution law, quenched Monte Carlo, exact correction, horizon
* ``measured``     row statistics against the i.i.d. law: dilution, alpha versus n, slope heatmap
* ``diagnostics``  estimator agreement and where the score model's assumptions fail
* ``budget``       the attention budget: mass on sinks, local window and far keys against n
* ``drift``        dilution or distance drift: the far profile against its continuation, the verdict
* ``eval``         ``sharpdraft eval --plot``: mass, agreement and acceptance versus n per variant (pyplot)
* ``files``        statistics files: loading with their stored settings, the standard set of PNGs
* ``style``        what every figure shares (canvas, log-n axis, colours, atomic PNG)

Only ``files`` speaks of command-line options; the figures take plain arguments.
"""

from .budget import BudgetCurve, budget_curve, budget_figure, format_budget_table
from .diagnostics import (LayerDiagnostics, assumption_figure, estimator_figure, format_failures, format_results,
                          layer_diagnostics)
from .drift import drift_figure, far_profile
from .files import BUDGET_FIGURE, DRIFT_FIGURE, STANDARD_FIGURES, describe_stats, load_stats, write_standard_figures
from .measured import (alpha_figure, by_length, dilution_law, dilution_table, format_dilution_table,
                       measured_dilution_figure, slope_heatmap_figure)
from .style import save_figure
from .theory import correction_figure, dilution_law_figure, horizon_figure, quenched_figure

__all__ = [
    "dilution_law_figure", "quenched_figure", "correction_figure", "horizon_figure",
    "measured_dilution_figure", "alpha_figure", "slope_heatmap_figure", "estimator_figure", "assumption_figure",
    "LayerDiagnostics", "layer_diagnostics", "by_length", "dilution_law", "save_figure", "load_stats",
    "write_standard_figures", "STANDARD_FIGURES", "describe_stats", "dilution_table", "format_dilution_table",
    "format_results", "format_failures", "BudgetCurve", "budget_curve", "budget_figure", "format_budget_table",
    "BUDGET_FIGURE", "DRIFT_FIGURE", "drift_figure", "far_profile",
]
