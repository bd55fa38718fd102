"""DFlash blocks in the one speculative loop and in the teacher-forced measurement.

A block drafter proposes a whole draft in **one** forward: the pending token ``x_N`` at position
``N`` followed by ``B - 1`` mask tokens at ``N + 1 .. N + B - 1``, attending (non-causally inside
the block) to the fused target features of the committed context ``x_0 .. x_{N-1}``; row ``j`` of
the block drafts token ``N + j``. :class:`DFlashBlockProposer` is that proposer behind the
``BlockProposer`` protocol (``calibrate.drafters.base``), so ``calibrate.speculative.speculative_generate``
verifies and commits its drafts exactly as it does a chain's (greedy, or speculative sampling: each
row's draft is drawn from its own law, and those laws do not depend on the other rows' draws, so the
per-position rejection rule keeps the target's law). The context features' keys and values are
computed once per committed token and extended after each verification, never recomputed, as
z-lab/dflash keeps them in its draft cache.

What a spec changes in a block (:func:`context_columns`):

* the scale multiplies every block query by ``alpha(n)``, ``n`` the keys the query sees (the kept
  context keys plus the whole block in a full layer), through the same attention tap the other
  drafters use (``calibrate.taps.ScalingTap``);
* a ``window`` W (with ``sinks`` S) is the runtime's rule read at the block's anchor position ``p``:
  the context keys ``c > p - W`` stay visible, and ``c < S``; the block itself always does. At
  ``n = p + 1 <= W`` nothing is dropped, so a window of ``n_ref`` leaves a block alone at ``n <= n_ref``;
* a distance fix (``positions``: clamp, group, pi) computes each logit at the remapped positions of
  its query and key, the block's rows at ``p + j`` and its keys at their own positions (the context's,
  then the block's, some after the row: near by any window, so unchanged), through the tap's
  :func:`sharpdraft_runtime.hf.positions_attention` with the head's own ``inv_freq``. Until a pair is
  past the fix's window (pi: a row past ``n_ref``) the plain kernel runs.

Teacher-forced (:func:`block_teacher_forced`): the anchor at every position ``t`` of a text, its
block's row 1 guessing token ``t + 1`` (the adapter's ``predicts = 1``), against the target's
greedy token and next-token law there. Many anchors run in one call with per-layer masks
(:func:`anchored_masks`): every block's rows see the context keys before their own anchor and their
own block only, which is what one block at a time computes (tests/test_dflash_blocks.py holds the
two equal).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from sharpdraft_theory import ScaleSpec

from .base import AttentionTap, ForcedRows, TeacherForced, forced_runs, pick_rows

__all__ = ["DFlashBlockProposer", "anchored_masks", "block_ids", "block_tap", "block_teacher_forced", "context_columns"]

ANCHORS_PER_CALL = 32  # blocks batched into one drafter forward by the teacher-forced pass


def block_tap(model, spec: ScaleSpec | None):
    """The tap a block runs under: ``spec``'s scale on every query, its distance fix (if any) on the logits."""
    from ..taps import ScalingTap, attention_tap

    fixed = spec is not None and spec.positions is not None
    return attention_tap(model, ScalingTap(spec), restrict=spec if fixed else None,
                         inv_freq=model.inv_freq(model.fc.weight.device) if fixed else None)


def context_columns(spec: ScaleSpec | None, p: int) -> torch.Tensor | None:
    """The context positions a block anchored at ``p`` keeps under ``spec``'s window and sinks (None: all ``p``).

    >>> window = lambda w, s=None: ScaleSpec(law="constant", n_ref=None, slope=0.0, top_k=4, window=w, sinks=s)
    >>> context_columns(window(4, 1), 9).tolist()
    [0, 6, 7, 8]
    >>> context_columns(window(4), 3) is None
    True
    """
    if spec is None or spec.window is None or p <= spec.window - 1:
        return None
    recent = torch.arange(p - spec.window + 1, p)
    sinks = torch.arange(min(spec.sinks or 0, int(recent[0])))
    return torch.cat((sinks, recent))


def anchored_masks(model, anchors: torch.Tensor, width: int, spec: ScaleSpec | None = None) -> list[torch.Tensor]:
    """Per-layer bool masks (1, 1, a * B, width + a * B) for the blocks at ``anchors`` (a,) in one call.

    Keys are the first ``width`` context positions, then the ``a`` blocks one after another. Row
    ``j`` of the block at ``t`` sees context position ``c`` when ``c < t``, its layer allows it
    (full layers: all; sliding ones, :meth:`DFlashDraftModel.visible_mask`: ``c > t + j - W_layer``)
    and ``spec``'s window keeps it (:func:`context_columns`), and the keys of its own block (all in
    full layers, offsets ``<= j`` in sliding ones); nothing of another block.
    """
    c = model.config
    B, a = c.block_size, len(anchors)
    device = anchors.device
    t = anchors.repeat_interleave(B)[:, None]  # (aB, 1) each row's anchor
    j = torch.arange(B, device=device).repeat(a)[:, None]  # (aB, 1) each row's offset in its block
    col = torch.arange(width, device=device)[None]  # (1, width) context positions
    ctx = col < t
    if spec is not None and spec.window is not None:
        ctx &= (col > t - spec.window) | (col < (spec.sinks or 0))
    owner = torch.arange(a, device=device).repeat_interleave(B)  # (aB,) the block each key belongs to
    own = owner[:, None] == owner[None, :]  # (aB, aB)
    offset = torch.arange(B, device=device).repeat(a)[None]  # (1, aB) each block key's offset
    masks = []
    for i in range(c.num_hidden_layers):
        if c.layer_types and c.layer_types[i] == "sliding_attention":
            layer_ctx = ctx & (col > t + j - c.sliding_window)
            layer_own = own & (offset <= j)
        else:
            layer_ctx, layer_own = ctx, own
        masks.append(torch.cat((layer_ctx, layer_own), dim=1)[None, None])
    return masks


def _embed(model, target, ids: torch.Tensor) -> torch.Tensor:
    embed = model.embed_tokens if model.embed_tokens is not None else target.get_input_embeddings()
    return embed(ids).to(model.fc.weight.dtype) * model.config.input_embedding_scale


def block_ids(model, anchors: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks at ``anchors`` (a,) whose anchor tokens are ``tokens`` (a,): ids (1, a * B), each anchor token
    then ``B - 1`` mask tokens, and their positions (1, a * B)."""
    B = model.config.block_size
    ids = torch.full((len(anchors), B), model.config.mask_token_id, dtype=torch.long, device=anchors.device)
    ids[:, 0] = tokens
    pos = anchors[:, None] + torch.arange(B, device=anchors.device)
    return ids.view(1, -1), pos.view(1, -1)


@torch.no_grad()
def block_teacher_forced(model, target, input_ids: torch.Tensor, hidden_state_ids, runs: Sequence[
        tuple[ScaleSpec | None, AttentionTap | None]], temperature: float = 1.0,
        proposals: torch.Tensor | None = None, pointer=None) -> TeacherForced:
    """Row ``t`` of ``input_ids`` (1, T): the block anchored at ``t`` (token ``x_t``, context ``x_0 .. x_{t-1}``)
    and its row 1's guess of token ``t + 1``, per run ``(spec, tap)``; the target once for the
    features and its law. The taps are not called: the keys of a batched call are laid out as in
    :func:`anchored_masks`, not as the first ``n_visible`` keys a tap (the attention-mass meter) reads,
    so eval reports no mass for blocks (``sharpdraft calibrate`` measures it, one block at a time).
    With a copy ``pointer`` (``calibrate.drafters.pointer``) row 1's law has the copies mixed in: it wraps the
    blocks' arm."""
    from ..measure.metrics import NextTokenLaw
    from .pointer import PointerArm
    from .target import hidden_state_features

    device = model.fc.weight.device
    input_ids = input_ids.to(device)
    T = input_ids.shape[1]
    layers = len(target.get_decoder().layers)
    states = hidden_state_features(target, input_ids, (*hidden_state_ids, layers))
    width = target.config.hidden_size
    features, final = states[:, :, :-width], states[0, :, -width:]
    law = NextTokenLaw(target.get_output_embeddings()(final), temperature, points=proposals)  # row t: token t + 1
    context = model.encode_context(features.to(model.fc.weight.dtype), torch.arange(T, device=device)[None])
    arm = _BlockArm(model, target, input_ids, context)
    if pointer is not None:
        arm = PointerArm(arm, pointer, input_ids[0], model.config.vocab_size)
    return forced_runs(arm, runs, law, T)


class _BlockArm:
    """The teacher-forced arm of a DFlash model (``calibrate.drafters.base.ForcedArm``): the blocks anchored at
    every position of ``input_ids`` (1, T), :data:`ANCHORS_PER_CALL` a call, over the target's ``context``
    keys and values; row ``t`` is the block at ``t``'s row 1. Its ``tap`` is not called (the docstring above)."""

    columns = None

    def __init__(self, model, target, input_ids: torch.Tensor, context):
        self.model, self.target, self.input_ids, self.context = model, target, input_ids, context

    def __call__(self, spec, tap):
        model, T = self.model, self.input_ids.shape[1]
        device, B = self.input_ids.device, model.config.block_size
        for a0 in range(0, T, ANCHORS_PER_CALL):
            anchors = torch.arange(a0, min(a0 + ANCHORS_PER_CALL, T), device=device)
            ids, pos = block_ids(model, anchors, self.input_ids[0, anchors])
            width_c = int(anchors[-1])  # the last anchor's context: every other block's is a prefix of it
            masks = anchored_masks(model, anchors, width_c, spec)
            with block_tap(model, spec):
                hidden = model.forward_block(_embed(model, self.target, ids), pos,
                                             [(k[:, :, :width_c], v[:, :, :width_c]) for k, v in self.context], masks)
            logits = model.compute_logits(hidden.view(len(anchors), B, -1)[:, 1], self.target)  # (a, vocab): row 1
            yield ForcedRows(anchors, logits, anchors, anchors, anchors + 1)  # n_visible: the bucket's count, t + 1


class DFlashBlockProposer:
    """Block drafting with a DFlash model (module docstring): one forward drafts ``B - 1`` tokens (a
    ``BlockProposer``, ``calibrate.drafters.base``).

    State after :meth:`start`: the context keys and values of ``x_0 .. x_{N-1}`` per layer (true target
    features) and the pending ``x_N``. :meth:`propose` runs the block at ``N``; :meth:`commit` adds the
    features of the pending token and the accepted drafts to the context. ``forwards`` counts the
    drafter's forwards (one per draft).
    """

    name = "dflash"

    def __init__(self, model, target, spec: ScaleSpec | None = None):
        self.model, self.target, self.spec = model, target, spec
        self.feature_ids = tuple(model.config.hidden_state_ids)
        self.block_size = model.config.block_size
        self.forwards = 0

    def close(self) -> None:
        """Nothing to undo: the spec lives in this proposer's tap."""

    def start(self, prompt: torch.Tensor, features: torch.Tensor, pending: int) -> None:
        """Context ``x_0 .. x_{N-1}`` from its target ``features`` (1, N, ·); ``x_N = pending``."""
        self.context = None
        self.length = 0
        self._extend(features)
        self.pending = pending

    def _extend(self, features: torch.Tensor) -> None:
        model = self.model
        n = features.shape[1]
        pos = torch.arange(self.length, self.length + n, device=features.device)[None]
        new = model.encode_context(features.to(model.fc.weight.dtype), pos)
        self.context = new if self.context is None else [
            (torch.cat((k0, k1), dim=2), torch.cat((v0, v1), dim=2)) for (k0, v0), (k1, v1) in zip(self.context, new)]
        self.length += n

    @torch.no_grad()
    def block_logits(self, rows: int | None = None) -> torch.Tensor:
        """The block at ``N``'s draft logits (r, vocab), rows 1 .. r with ``r = min(rows, B - 1)`` (all B - 1 when
        ``rows`` is None). The whole block runs (its rows see one another); only the ``r`` rows a verification
        reads go through the output head, the drafter's largest matrix (only its draft vocabulary's rows, when
        the head has one: :meth:`DFlashDraftModel.compute_logits`)."""
        model, N = self.model, self.length
        device = model.fc.weight.device
        anchor = torch.tensor([N], device=device)
        ids, pos = block_ids(model, anchor, torch.tensor([self.pending], device=device))
        keep = context_columns(self.spec, N)
        context = self.context if keep is None else [(k[:, :, keep], v[:, :, keep]) for k, v in self.context]
        with block_tap(model, self.spec):
            hidden = model.forward_block(_embed(model, self.target, ids), pos, context, context_positions=keep)
        self.forwards += 1
        last = self.block_size if rows is None else 1 + min(rows, self.block_size - 1)
        return self.model.compute_logits(hidden[0, 1:last], self.target)

    def draft_logits(self, k: int) -> torch.Tensor:
        """Rows 1 .. min(k, B - 1) of the block at ``N`` (:meth:`block_logits`): (min(k, B - 1), vocab)."""
        return self.block_logits(k)

    def propose(self, k: int, rule) -> tuple[list[int], np.ndarray | None]:
        """``min(k, B - 1)`` drafts from one forward, row ``j`` picked by ``rule`` from its own logits,
        with their laws over the target vocabulary (None: greedy)."""
        return pick_rows(self.block_logits(k), rule)

    def commit(self, new: list[int], features: torch.Tensor) -> None:
        """The pending token and the accepted drafts join the context (their ``features`` (1, len(new), ·));
        the target's own choice, ``new[-1]``, is pending."""
        self._extend(features)
        self.pending = new[-1]
