"""What a serving engine needs to apply a scale spec to its drafter: engine-free, so it is tested without one.

A serving engine batches requests into one attention call per layer: the call's query rows are the
tokens of every scheduled request laid end to end, ``query_start_loc`` (R + 1,) says where each
request's rows start, and ``seq_lens`` (R,) how many keys each request has once this call's keys are
cached. Row ``j`` of request ``r`` (``q_len = query_start_loc[r + 1] - query_start_loc[r]`` rows, the
last ones of its sequence) sees ``seq_len - q_len + j + 1`` keys, or ``W`` of them under a sliding window
of ``W`` keys (:func:`visible_counts`). :class:`TokenScaler` turns those counts into each row's
``alpha(n)`` and multiplies the queries in place.

Which layers are the drafter's: vLLM's EAGLE-3 drafter names its attention layers
``model.layers.{L + i}...`` after the target's ``L`` layers (:func:`drafter_layer`).

Which specs an engine can apply (:func:`load_spec`, :func:`check_engine`): every law, at every
granularity; a ``window`` through the engine's own sliding-window attention (vLLM keeps the last
``W`` keys, the query's own included: the spec's rule); not ``sinks`` (vLLM's attention sinks are learned
per-head logits, not the first keys kept beside a window), not a distance fix (``positions``), and
not a drafter with a copy pointer. Each refusal is one line naming the field.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from sharpdraft_theory import ScaleSpec, SpecError

from .core import QueryScaler

__all__ = ["SPEC_ENV", "TRACE_ENV", "KIND", "spec_path", "load_spec", "check_engine", "drafter_layer",
           "visible_counts", "TokenScaler", "trace"]

SPEC_ENV = "SHARPDRAFT_SPEC"  # path of the spec the engine applies to its drafter; unset or empty: no effect
TRACE_ENV = "SHARPDRAFT_TRACE"  # a file: every scaled drafter call and every layer's routing, as JSON lines
KIND = "eagle3"  # the drafter kind served: vLLM's EAGLE-3 drafter (speculative method "eagle3")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def spec_path(environ=os.environ) -> str | None:
    """The spec's path from ``SHARPDRAFT_SPEC``, or None when it is unset or empty (the plugin does nothing)."""
    return environ.get(SPEC_ENV) or None


def load_spec(path: str | os.PathLike) -> ScaleSpec:
    """The spec at ``path``, validated (``ScaleSpec.load``) and checked servable: a one-line ``SpecError`` if not.

    >>> import tempfile
    >>> f = Path(tempfile.mkdtemp()) / "spec.json"
    >>> _ = f.write_text('{"law": "log-linear", "n_ref": 64, "slope": 0.2, "top_k": 4, "window": 32, "sinks": 4}')
    >>> load_spec(f)
    Traceback (most recent call last):
    ...
    sharpdraft_theory.checks.SpecError: spec file '...spec.json': field 'sinks' (4): vLLM keeps no first keys ...
    """
    spec = ScaleSpec.load(path)
    where = f"spec file {str(path)!r}"
    if spec.positions is not None:
        raise SpecError(f"{where}: field 'positions' ({spec.positions.fix}): a distance fix is not applied in vLLM "
                        "(its attention kernel takes no remapped positions); serve a spec without positions")
    if spec.sinks is not None:
        raise SpecError(f"{where}: field 'sinks' ({spec.sinks}): vLLM keeps no first keys beside a window (its "
                        "attention sinks are learned logits); serve the window alone")
    if spec.drafter is not None and spec.drafter.kind != KIND:
        raise SpecError(f"{where}: field 'drafter.kind' ({spec.drafter.kind}): vLLM serves this spec on an "
                        f"{KIND} drafter only; calibrate one for the EAGLE-3 head")
    return spec


def check_engine(spec: ScaleSpec, *, cpu: bool, method: str | None, draft_layers: int, draft_heads: int,
                 draft_length: int, serving_length: int, draft_path: str | None) -> None:
    """A one-line ``SpecError`` unless the engine so configured can apply ``spec`` to its drafter.

    ``cpu``: the engine runs vLLM's CPU attention (the one the plugin wraps); ``method``: the speculative
    method (None: no drafter); ``draft_layers`` x ``draft_heads``: the drafter's attention; ``draft_length``
    its maximum length, ``serving_length`` the engine's (vLLM stops drafting, silently, past the drafter's).
    """
    if not cpu:
        raise SpecError(f"{SPEC_ENV}: the plugin wraps vLLM's CPU attention only; this engine runs another platform")
    if method != KIND:
        raise SpecError(f"{SPEC_ENV}: the spec scales an EAGLE-3 drafter, and this engine's speculative method is "
                        f"{method or 'none'}; serve with speculative_config method eagle3, or unset {SPEC_ENV}")
    if draft_path is not None and (Path(draft_path) / "copy_pointer.json").is_file():
        raise SpecError(f"the drafter {draft_path} has a copy pointer (copy_pointer.json), which vLLM does not "
                        "serve; serve its head alone")
    spec.check_fits(draft_layers, draft_heads, "the engine's drafter")
    if draft_length < serving_length:
        raise SpecError(f"the drafter's max_position_embeddings {draft_length} is below the serving length "
                        f"{serving_length}: vLLM stops drafting past it without a word; raise it with "
                        "`sharpdraft export` (the spec keeps n_ref)")


def drafter_layer(layer_name: str, target_layers: int, draft_layers: int) -> int | None:
    """The drafter's layer index of the attention layer ``layer_name``, or None for a target's layer.

    >>> drafter_layer("model.layers.30.self_attn.attn", 30, 1), drafter_layer("model.layers.29.self_attn.attn", 30, 1)
    (0, None)
    """
    match = _LAYER.search(layer_name)
    index = None if match is None else int(match.group(1)) - target_layers
    return index if index is not None and 0 <= index < draft_layers else None


def visible_counts(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int,
                   window: int | None = None) -> torch.Tensor:
    """Keys each query row sees: ``seq_len - q_len + j + 1`` for row ``j`` of its request, at most ``window``.

    Parameters
    ----------
    query_start_loc : Tensor of shape (R + 1,), integers
        Where each request's rows start (the last entry: all rows).
    seq_lens : Tensor of shape (R,), integers
        Keys of each request once this call's are cached.
    num_tokens : int
        Real rows (the first ``num_tokens``; rows past them are padding).
    window : int, optional
        A sliding window of that many keys.

    Returns
    -------
    Tensor of shape (num_tokens,), int64

    >>> visible_counts(torch.tensor([0, 3, 4]), torch.tensor([10, 7]), 4).tolist()
    [8, 9, 10, 7]
    """
    starts = query_start_loc.to(torch.int64)
    ends = starts[1:]
    rows = int(starts[-1])
    offset = seq_lens[:len(ends)].to(torch.int64) - ends  # n = t + 1 + seq_len - (end of its request's rows)
    n = torch.arange(1, rows + 1, dtype=torch.int64) + torch.repeat_interleave(offset, ends - starts[:-1],
                                                                               output_size=rows)
    n = n[:num_tokens]
    return n if window is None else n.clamp_(max=window)


class TokenScaler:
    """A spec compiled for a serving engine's flat query rows (num_tokens, heads, head_dim).

    >>> scaler = TokenScaler(ScaleSpec(law="log-linear", n_ref=4, slope=1.0, top_k=1))
    >>> scaler.factors(torch.tensor([4, 8]), layer=0).flatten().tolist()
    [1.0, 1.6931471824645996]
    """

    def __init__(self, spec: ScaleSpec, dtype: torch.dtype = torch.float32):
        self.spec = spec
        self.window = spec.window
        self.limit = spec.identity_limit()  # alpha is 1 up to here: a call whose rows all see at most this many keys is left alone
        self._scaler = QueryScaler(spec, dtype=dtype)
        self._per_layer = spec.granularity != "global"

    def active(self, seq_lens: torch.Tensor) -> bool:
        """Whether some row of a call with these ``seq_lens`` has ``alpha != 1`` (a row sees at most its seq_len keys)."""
        if self.limit == float("inf"):
            return False
        longest = int(seq_lens.max()) if seq_lens.numel() else 0
        return (longest if self.window is None else min(longest, self.window)) > self.limit

    def factors(self, n: torch.Tensor, layer: int) -> torch.Tensor:
        """``alpha(n)`` of shape (num_tokens, heads or 1, 1) for counts ``n`` (num_tokens,) in the drafter's ``layer``."""
        return self._scaler.alpha(n, layer if self._per_layer else None)[0].T[..., None]

    def scale_(self, query: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int,
               layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Multiply the first ``num_tokens`` rows of ``query`` (tokens, heads, head_dim) by their ``alpha(n)`` in place.

        Returns ``(n, alpha)`` when it scaled, None when every factor is 1 (the query untouched).
        """
        if not self.active(seq_lens):
            return None
        n = visible_counts(query_start_loc, seq_lens, num_tokens, self.window)
        alpha = self.factors(n, layer)
        query[:num_tokens].mul_(alpha)  # in alpha's float32, rounded once to the query's dtype
        return n, alpha


def trace(path: str, record: dict) -> None:
    """Append ``record`` as one JSON line to ``path`` (``SHARPDRAFT_TRACE``; for tests, not for serving)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
