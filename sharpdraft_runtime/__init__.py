"""SharpDraft runtime: apply a scale spec to a drafter's attention queries at inference.

A speculative-decoding drafter trained at a short context loses attention mass on its top keys
as the number of visible keys ``n`` grows; SharpDraft multiplies each query by ``alpha(n)``
(cardinality-aware query scaling, ``docs/theory.md``). This package applies a
:class:`sharpdraft_theory.ScaleSpec` exactly, in place and at no memory cost:

* :func:`alpha_for`, :func:`scale_query_`, :class:`QueryScaler` - the core, for custom attention code;
* :func:`query_hook` - the same for attention code with a query hook (calibrate's EAGLE-3 head);
* :func:`visible_keys` - the keys each query row of an attention call sees (the ``n`` of ``alpha(n)``);
  :func:`causal_n_visible`, :func:`mask_n_visible` - the same from positions or from a mask;
* :func:`flex_score_mod` - the same scaling as a FlexAttention ``score_mod``; :func:`flex_mask_mod` - the
  spec's window and sinks as a FlexAttention ``mask_mod``;
* :func:`enable` / :func:`disable` - transformers models, through the attention interface;
* :mod:`sharpdraft_runtime.positions` - a spec's distance fix (clamp, group, pi): attention at remapped
  RoPE positions, applied by :func:`enable` and calibrate's EAGLE-3 head.
"""

from .core import (QueryScaler, alpha_for, causal_n_visible, flex_mask_mod, flex_score_mod, mask_n_visible,
                   query_hook, scale_query_, visible_keys)
from .visible import causal_mask, window_overlay
from .hf import NAME, disable, enable, is_enabled, sharpdraft_attention

__all__ = ["QueryScaler", "alpha_for", "scale_query_", "query_hook", "visible_keys", "causal_n_visible", "mask_n_visible",
           "causal_mask", "window_overlay", "flex_score_mod", "flex_mask_mod",
           "NAME", "enable", "disable", "is_enabled", "sharpdraft_attention"]
