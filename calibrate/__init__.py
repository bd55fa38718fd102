"""SharpDraft calibration: collect attention-logit statistics from a drafter and fit the slope.

The ``sharpdraft`` command line lives here too (``calibrate.cli``).
"""
