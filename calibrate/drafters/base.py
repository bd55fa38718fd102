"""What every drafter adapter provides, and the attention tap it calls.

An adapter loads one kind of drafter (and its target, for feature-based drafters) and runs it over
a token sequence in the ways the commands need:

* ``collect`` (``sharpdraft calibrate``): hand each attention layer's post-RoPE queries and keys
  to a tap, which keeps the query rows it wants and reduces them to statistics at once
  (``calibrate.collect``), so no adapter ever holds an n x n attention matrix;
* ``teacher_forced`` and ``proposer`` (``sharpdraft eval``, for the kinds whose registry entry
  says ``evaluates``): the drafter's greedy guesses over a text the target wrote, with and without
  query scaling, and a :class:`Proposer` that drafts in the one speculative loop
  (``calibrate.speculative.speculative_generate``), greedy or sampled.

An adapter loads and teacher-forces; a proposer drafts. Proposers compose: prompt lookup, lookup
before a model, and a copy pointer each wrap another proposer (``calibrate.lookup``,
``calibrate.drafters.pointer``).

Documents are packed for every command by one rule (``calibrate.corpus.pack``): joined with the
adapter's ``eos_token_id``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from sharpdraft_theory import ScaleSpec
from sharpdraft_theory.spec import DrafterInfo

__all__ = ["AttentionTap", "Adapter", "Proposer", "BlockProposer", "ChainProposer", "TeacherForced", "ForcedRows",
           "ForcedArm", "forced_runs", "pick_rows"]


class AttentionTap(Protocol):
    def __call__(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, scaling: float,
                 n_visible: torch.Tensor) -> torch.Tensor | None:
        """Receive one attention call, before its logits are formed.

        Parameters
        ----------
        layer_idx : int
            Attention layer index in the drafter (0 for a one-layer EAGLE-3 head).
        query : Tensor, shape (batch, heads, q_len, head_dim)
            Post-RoPE queries (before any query scaling).
        key : Tensor, shape (batch, kv_heads, k_len, head_dim)
            Post-RoPE keys, including cached context; ``heads % kv_heads == 0`` (GQA).
        scaling : float
            Softmax scale (``head_dim ** -0.5`` unless the model says otherwise).
        n_visible : LongTensor, shape (batch, q_len)
            Keys each query attends to (:func:`sharpdraft_runtime.visible_keys`). In the layouts
            that calibration and eval run (one unpadded sequence, causal rows or non-causal
            blocks, no window) they are the first ``n_visible[b, i]`` positions of ``key``; under a
            spec's ``window`` and ``sinks`` they are the keys that rule keeps
            (``sharpdraft_runtime.causal_mask``).

        Returns
        -------
        None, or a Tensor of the shape of ``query``
            None leaves the call as it is (after any in-place change of ``query``); a tensor is
            attended in place of ``query`` (query scaling).
        """


@dataclass(frozen=True)
class TeacherForced:
    """The drafter's guesses over a text, next to the target's, one row per query row."""

    n_visible: torch.Tensor  # (rows,) keys the row's query sees in the drafter's attention
    target_next: torch.Tensor  # (rows,) the target's greedy token at the row's place in the text
    drafted: torch.Tensor  # (runs, rows) the drafter's greedy token (target vocabulary), one row per run
    accept: torch.Tensor  # (runs, rows) sum_x min(p_T, q_T): the row's acceptance probability under sampling at T
    proposed_accept: torch.Tensor | None = None  # (rows,) p_T(x) of the proposals' tokens (0 where none), if asked


@dataclass(frozen=True)
class ForcedRows:
    """Some rows of one teacher-forced arm: the drafter's guesses of the token after ``x_t`` of a text."""

    rows: torch.Tensor  # (r,) the rows' indices in TeacherForced (and in the target's law), increasing by one
    logits: torch.Tensor  # (r, columns) the guesses' logits (log laws over the target vocabulary after a pointer)
    positions: torch.Tensor  # (r,) t: the row knows x_0 .. x_t and guesses x_{t+1}
    counts: torch.Tensor  # (r,) the count of keys a spec's factor takes for the row (a copy pointer's)
    n_visible: torch.Tensor  # (r,) keys the row's query sees in the drafter's attention
    columns: torch.Tensor | None = None  # (columns,) target id of each logits column; None: column i is id i

    def drafted(self) -> torch.Tensor:
        """The greedy guesses (r,), target ids."""
        best = self.logits.argmax(-1)
        return best if self.columns is None else self.columns[best]


class ForcedArm(Protocol):
    """How an adapter's teacher-forced pass runs the drafter once per arm over one text (the target already
    run): called with the arm's ``(spec, tap)``, it yields the arm's rows, all of them, in chunks. A copy
    pointer wraps an arm (``calibrate.drafters.pointer.PointerArm``)."""

    columns: torch.Tensor | None  # the columns its rows' logits have (the target's law is formed over them)

    def __call__(self, spec: ScaleSpec | None, tap: AttentionTap | None) -> Iterator[ForcedRows]:
        """The arm's rows under ``spec`` (None: unscaled), its queries shown to ``tap``."""


def forced_runs(arm: ForcedArm, runs: Sequence[tuple[ScaleSpec | None, AttentionTap | None]], law,
                size: int) -> TeacherForced:
    """Run ``arm`` once per ``(spec, tap)`` of ``runs`` and gather its ``size`` rows against ``law`` (a
    ``calibrate.measure.metrics.NextTokenLaw`` with one row per teacher-forced row): the drafted tokens and
    the acceptance, one row per run, and the visible keys of the last run."""
    drafted = torch.empty(len(runs), size, dtype=torch.long, device=law.greedy.device)
    accept = torch.empty(len(runs), size, dtype=torch.float32, device=law.greedy.device)
    n_visible = None
    for r, (spec, tap) in enumerate(runs):
        for part in arm(spec, tap):
            if n_visible is None:
                n_visible = torch.empty(size, dtype=part.n_visible.dtype, device=part.n_visible.device)
            drafted[r, part.rows] = part.drafted().to(drafted.device)
            accept[r, part.rows] = law.acceptance(part.logits, start=int(part.rows[0])).to(accept.device)
            n_visible[part.rows] = part.n_visible
    return TeacherForced(n_visible=n_visible, target_next=law.greedy, drafted=drafted, accept=accept,
                         proposed_accept=law.point_accept)


@runtime_checkable
class Proposer(Protocol):
    """What proposes drafts to the one speculative loop, greedy or sampled
    (``calibrate.speculative.speculative_generate``): a model's chain (EAGLE-3), a block (DFlash),
    parallel drafts (PARD), a causal LM's chain (``hf``), prompt lookup (``calibrate.lookup``), lookup
    with a model behind it, a model with a copy pointer, or nothing at all (the target-only
    baseline, ``calibrate.speculative.NoProposer``). They differ in how they propose, not in how a
    draft is verified and committed (transformers' ``CandidateGenerator``, vLLM's proposers).

    State: committed tokens ``x_0 .. x_N``; ``x_N`` (the target's last choice) is pending.
    """

    name: str  # what drafts, recorded by the loop (eagle3, lookup, lookup+eagle3, none, ...)
    feature_ids: tuple[int, ...] | None  # target hidden_states the proposer reads; None: none

    def start(self, prompt: torch.Tensor, features: torch.Tensor | None, pending: int) -> None:
        """Begin after ``prompt`` (1, N) with its target features (1, N, ·) and the pending token."""

    def propose(self, k: int, rule) -> tuple[list[int], np.ndarray | None]:
        """Up to ``k`` drafts (target vocabulary) following the pending token (fewer, or none, when the
        proposer has nothing to propose: the step then verifies the pending token alone), and the laws
        they were drawn from over the target vocabulary (len, vocab) float64, None when ``rule`` reads
        none (greedy). A model drafts each by ``rule`` (``calibrate.speculative``: ``rule.pick(logits)``
        gives the token index in its logits and its law, None for greedy), each step conditioned on
        the tokens picked before; a point-mass proposer (lookup) hands back one-hot laws."""

    def commit(self, new: list[int], features: torch.Tensor | None) -> None:
        """The target accepted ``new`` (accepted drafts then its own choice, now pending);
        ``features`` (1, len(new), ·) of the pending token and the accepted drafts. A step whose
        drafts came from elsewhere (``lookup+head``) commits without a ``propose`` call."""

    def close(self) -> None:
        """Undo anything done to shared models (runtime bindings)."""

    # Optional, for a proposer that learns from the target (``calibrate.online.OnlineProposer``); the loop
    # calls it, where it exists, just before ``commit``:
    #
    #     def verified(self, logits: torch.Tensor) -> None:
    #         """The target's logits (len(new), vocab) after the pending token and each accepted draft."""


@runtime_checkable
class BlockProposer(Proposer, Protocol):
    """A proposer whose drafts all come from one forward that does not read them (DFlash blocks, PARD's
    parallel drafts): it declares the logits of that forward, which ``calibrate.measure.blocks`` measures
    and a copy pointer mixes into. Its ``propose`` is :func:`pick_rows` of them."""

    def draft_logits(self, k: int) -> torch.Tensor:
        """The logits (r, vocab) of one forward after the pending token, ``r <= k``, row ``j`` guessing
        ``x_{N+1+j}`` (target vocabulary); the forward leaves no trace in the proposer's state."""


@runtime_checkable
class ChainProposer(Proposer, Protocol):
    """A proposer that drafts one token a step, each step reading the token drafted before (the
    EAGLE-3 head): it declares the step, so a copy pointer can mix into each row's law before the
    row's token is picked. Its ``propose`` picks ``k`` tokens, each from ``row_logits`` of the ones
    before it."""

    columns: torch.Tensor  # (columns,) the target id of each column of ``row_logits``
    vocab_size: int  # the target's vocabulary
    sliding_window: int | None  # the drafter's own attention window, if it has one

    def row_logits(self, drafted: list[int]) -> torch.Tensor:
        """The logits (columns,) of the row that guesses the token after the pending one and ``drafted``
        (target ids: this step's drafts so far, none at a step's first call, then one more a call)."""


def pick_rows(logits: torch.Tensor, rule) -> tuple[list[int], np.ndarray | None]:
    """A token per row of ``logits`` (r, vocab) picked by ``rule`` from that row alone (a
    :class:`BlockProposer`'s drafts), and their laws (r, vocab) float64 (None: greedy)."""
    drafts, laws = [], []
    for row in logits:
        token, law = rule.pick(row)
        drafts.append(int(token))
        if law is not None:
            laws.append(law)
    return drafts, (np.stack(laws) if laws else None)


class Adapter(Protocol):
    kind: str  # a key of calibrate.drafters.KINDS
    info: DrafterInfo  # identity and attention shape, recorded in the spec
    default_n_ref: int  # the drafter's training length (its training record, its config or a documented preset);
    # reading it raises UserError (saying to pass --n-ref) when the checkpoint states none that can be trusted
    notes: list[str]  # optional: what was read from the checkpoint and how (layout, layers read), for summaries
    device: torch.device  # where input ids go
    eos_token_id: int | None  # joins documents when a corpus is packed; None when the tokenizer has none

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` in the drafter's (or its target's) vocabulary, without special tokens."""

    def collect(self, input_ids: torch.Tensor, tap: AttentionTap, positions: torch.Tensor) -> None:
        """Run the drafter over ``input_ids`` (shape (1, T)) and call ``tap`` for every attention layer.

        ``positions`` (LongTensor, sorted, values in [0, T)) are the query positions calibration
        wants; causal drafters may run the whole prefill and let the tap select rows, block
        drafters (DFlash) place one block at each position.
        """

    # Kinds that evaluate (``KINDS[kind].evaluates``) also provide:

    target: torch.nn.Module  # the target model the drafter drafts for

    predicts: int  # teacher-forced row t guesses token t + predicts of the text (EAGLE-3: 2; next-token LMs: 1),
    # so a sequence of T tokens has T + 1 - predicts rows

    def teacher_forced(self, input_ids: torch.Tensor, runs: Sequence[tuple[ScaleSpec | None, AttentionTap | None]],
                       temperature: float = 1.0, proposals: torch.Tensor | None = None) -> TeacherForced:
        """The target once over ``input_ids`` (1, T), then the drafter once per ``(spec, tap)``, its
        queries scaled by ``spec`` (None: unscaled) and shown, scaled, to ``tap``; expected acceptance
        at ``temperature`` (``calibrate.measure.metrics.NextTokenLaw``). ``proposals`` (rows,): a
        target id per row drafted as a point mass (prompt lookup; -1: none), whose ``p_T`` comes back
        as ``proposed_accept``."""

    feature_ids: tuple[int, ...] | None  # target hidden_states its proposers read (None: none), for a shared prefill

    # A kind whose collection runs the target (EAGLE-3) may set ``keeps_target_states = True``: its
    # ``collect(..., keep_states=True)`` then returns the target's states of the text from that pass, which
    # ``teacher_forced(..., states=...)`` reads instead of running the target again (``calibrate --select``).

    def proposer(self, spec: ScaleSpec | None) -> Proposer:
        """A proposer with ``spec`` applied (None: unscaled), with the adapter's copy pointer if it has
        one; call its ``close`` when done."""
