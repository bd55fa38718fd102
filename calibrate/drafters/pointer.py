"""A copy pointer for an EAGLE-3 head: attention over the context by exact token match, mixed into the
head's law (a pointer-generator's copy distribution, in one attention with a sink).

Head row ``i`` holds its own token ``x_i`` (the target feature's position) and the token after it,
``x_{i+1}`` (its input). The row that drafts ``x_{t+2}`` is row ``t``; its known suffix ends
``.. x_t, x_{t+1}``. Each earlier row ``i <= t`` is a key whose **match** is the length of the
common suffix of ``.. x_{i-1}, x_i`` and ``.. x_t, x_{t+1}``, at most ``order`` tokens, and whose value
is the token that followed there, ``x_{i+1}``: where ``x_i = x_{t+1}`` (and the tokens before agree),
what came next last time is the guess now. That is prompt lookup's rule (:mod:`calibrate.lookup`),
written as attention:

* logit of key ``i``: ``alpha(n) * scale * match(t, i)`` (0 for a row that matches nothing; with
  ``unmatched = "masked"``, a row that matches nothing is no key at all, prompt lookup's own rule);
* one **sink** with logit ``alpha(n) * sink``: the head's own law;
* ``w = softmax`` over the sink and the ``n`` visible keys; the drafted law
  ``q = (1 - gain * (1 - w_sink)) * p_head + gain * sum_i w_i [x_{i+1}]``, over the target's whole
  vocabulary (a copied token need not be in the head's draft vocabulary).

``alpha(n)`` is the spec's query factor for the row's count of visible keys (the mean over the head's
query heads for a per-head spec), so a query scale acts on the pointer as on the head's attention, and a
spec's window and sinks hide the same keys from both. Distance fixes do not touch it: its logits depend
on content only. Every row that matches nothing adds ``exp(0)`` to the normaliser, so as ``n`` grows
the mass on a real match and on the sink dilutes, as the module's theory describes for any attention;
a masked pointer (``unmatched = "masked"``) has no such rows and does not dilute
(:meth:`CopyPointer.mass`; tests/test_pointer.py holds both against the float64 formula).

In decoding the pointer is a proposer that wraps the drafter's own (:func:`with_pointer`): it mixes
the copies into each law the inner proposer drafts from, a chain's row by row (each row knows the drafts
before it), a block's rows at once (row ``j`` copies the token ``j`` places after a match). In an
adapter's teacher-forced pass it wraps the pass's arm the same way (:class:`PointerArm`).

The pointer has no weights: four numbers, fitted by ``scripts/fit_copy_pointer.py``, stored in a head
directory's ``copy_pointer.json`` (:func:`read`), which may name the directory of the head it joins
(``"head"``), so that one head's weights serve with and without a pointer.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from sharpdraft_runtime import causal_mask

from ..errors import UserError
from .base import BlockProposer, ChainProposer, pick_rows

__all__ = ["FILE", "FORMAT", "MAX_ORDER", "UNMATCHED", "CopyPointer", "PointerArm", "PointerBlockProposer",
           "PointerChainProposer", "alpha", "block_mix", "check_unmatched", "describe", "keeping_slope", "limits",
           "locate", "matches", "read", "set_unmatched", "spec_block_mix", "unwrap", "with_pointer", "write"]

FILE = "copy_pointer.json"
FORMAT = "sharpdraft-copy-pointer"
MAX_ORDER = 8  # a longer suffix than this adds nothing a copy needs; bounds the work per row
UNMATCHED = ("scored", "masked")  # a row matching nothing: a key of logit 0, or no key
_CHUNK = 256  # query rows per pass over the vocabulary: (rows, vocab) float32 is 50 MB at SmolLM2's 49,152


@dataclass(frozen=True)
class CopyPointer:
    """The pointer's four numbers (module docstring); ``ValueError`` naming a bad one."""

    order: int = 2  # longest suffix matched, 1 .. MAX_ORDER
    scale: float = 8.0  # logit per matched token, > 0
    sink: float = 12.0  # the sink's logit (the head's own law), finite
    gain: float = 1.0  # share of the non-sink mass given to the copies, 0 .. 1
    unmatched: str = "scored"  # a row that matches nothing: "scored" (a key of logit 0) or "masked" (no key)

    def __post_init__(self):
        if isinstance(self.order, bool) or not isinstance(self.order, int) or not 1 <= self.order <= MAX_ORDER:
            raise ValueError(f"order must be an integer from 1 to {MAX_ORDER}, got {self.order!r}")
        for name in ("scale", "sink", "gain"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not self.scale > 0:
            raise ValueError(f"scale must be > 0, got {self.scale!r}")
        if not 0 <= self.gain <= 1:
            raise ValueError(f"gain must be from 0 to 1, got {self.gain!r}")
        if self.unmatched not in UNMATCHED:
            raise ValueError(f"unmatched must be {' or '.join(UNMATCHED)}, got {self.unmatched!r}")

    def to_dict(self) -> dict:
        """The numbers as a file and a result record them (``unmatched`` only when masked: files from before
        the option read as they were written)."""
        d = asdict(self)
        if d["unmatched"] == "scored":
            del d["unmatched"]
        return d

    def mix(self, head_logits: torch.Tensor, columns: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor,
            alpha: torch.Tensor | float, vocab_size: int, *, window: int | None = None,
            sinks: int | None = None, shift: int = 1) -> torch.Tensor:
        """Log of the drafted law over the target vocabulary, (rows, vocab_size), float32.

        ``head_logits`` (rows, draft_vocab) the head's logits of ``rows`` (a 1-D tensor of row indices,
        increasing by one), ``columns`` (draft_vocab,) their target ids, ``tokens`` (>= rows[-1] + 2,)
        the text ``x_0, x_1, ..`` (row ``i``'s input is ``tokens[i + 1]``), ``alpha`` one factor per row
        (or one for all), ``window`` / ``sinks`` the keys a row sees besides causality
        (:func:`sharpdraft_runtime.causal_mask`). Tokens that neither law gives mass are ``-inf``.

        ``shift`` ``s``: the law of the token ``s`` places after the row's known ``x_{t+1}`` (a block's row
        ``s``): key ``i`` brings back ``x_{i+s}``, and only keys whose ``x_{i+s}`` is known (``i + s <= t + 1``)
        take part. ``shift = 1`` is the EAGLE-3 row's own next guess.
        """
        first, count = int(rows[0]), len(rows)
        alpha = torch.as_tensor(alpha, dtype=torch.float32, device=head_logits.device).expand(count)
        out = torch.empty(count, vocab_size, dtype=torch.float32, device=head_logits.device)
        tokens = tokens.reshape(-1)
        for a in range(0, count, _CHUNK):
            b = min(a + _CHUNK, count)
            w, values, _ = self._attend(tokens, first + a, first + b, alpha[a:b], window, sinks, shift)
            values = values.to(out.device)
            copies = torch.zeros(b - a, vocab_size, dtype=torch.float32, device=out.device)
            copies.scatter_add_(1, values, w[:, 1:] * self.gain)  # each token's copied mass
            keep = 1 - self.gain * (1 - w[:, :1])  # (c, 1): the head's share
            # logs only where a law has mass (a dense log over the vocabulary costs more than all the rest):
            # the head's columns, then the copied tokens, whose law is the head's part plus the copies'
            part = out[a:b]
            part.fill_(float("-inf"))
            part[:, columns] = keep.log() + torch.log_softmax(head_logits[a:b].float(), dim=-1)
            head_there = part.gather(1, values).exp()
            part.scatter_(1, values, (head_there + copies.gather(1, values)).log())
        return out

    def mass(self, tokens: torch.Tensor, rows: torch.Tensor, alpha: torch.Tensor | float = 1.0, *,
             window: int | None = None, sinks: int | None = None) -> torch.Tensor:
        """(rows, 3) float32: the share of the pointer's attention on the sink, on keys that match, and on keys
        that match nothing (always 0 for a masked pointer), for ``rows`` of the text ``tokens`` (as :meth:`mix`).

        A scored pointer's ``U`` unmatched keys hold ``U / (e^{alpha sink} + U + sum_matched e^{alpha scale m})``,
        which grows toward 1 with the context: the dilution a query scale hands back.
        """
        first, count = int(rows[0]), len(rows)
        alpha = torch.as_tensor(alpha, dtype=torch.float32, device=tokens.device).expand(count)
        w, _, match = self._attend(tokens.reshape(-1), first, first + count, alpha, window, sinks, 1)
        keys = w[:, 1:]
        return torch.stack((w[:, 0], (keys * (match > 0)).sum(1), (keys * (match == 0)).sum(1)), dim=1)

    def _attend(self, tokens: torch.Tensor, lo: int, hi: int, alpha: torch.Tensor, window: int | None,
                sinks: int | None, shift: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query rows ``lo .. hi - 1`` over keys ``0 .. hi - 1``: ``(w, values, match)``, ``w`` (c, 1 + hi) the
        softmax over the sink and the keys, ``values`` (c, hi) the token each key brings back, ``match`` (c, hi)."""
        if shift < 1:
            raise ValueError(f"shift must be >= 1, got {shift}")
        match = matches(tokens, lo, hi, self.order)  # (c, hi)
        visible = causal_mask(hi - lo, lo, sliding_window=window, sinks=sinks, device=match.device)
        source = torch.arange(hi, device=match.device) + shift  # where key i's value sits
        if shift > 1:  # a value past the query's last known token is not known yet
            visible &= source[None] <= torch.arange(lo, hi, device=match.device)[:, None] + 1
        if self.unmatched == "masked":
            visible &= match > 0
        scaled = alpha[:, None]
        logits = (scaled * self.scale * match).masked_fill(~visible, float("-inf"))  # (c, hi)
        w = torch.softmax(torch.cat((scaled * self.sink, logits), dim=1), dim=1)  # (c, 1 + hi)
        values = tokens[source.clamp(max=tokens.numel() - 1)][None].expand(hi - lo, hi)  # x_{i+s}
        return w, values, match


def block_mix(pointer: CopyPointer, logits: torch.Tensor, tokens: torch.Tensor, alpha, *, window: int | None = None,
              sinks: int | None = None) -> torch.Tensor:
    """A block's rows with the pointer mixed in: ``logits`` (r, vocab) the drafter's rows 1 .. r after the known
    text ``tokens`` = ``x_0 .. x_N`` (row ``j`` guesses ``x_{N+j}``), the log laws (r, vocab). Row ``j`` copies
    the token ``j`` places after each earlier match of the known suffix (:meth:`CopyPointer.mix`, ``shift = j``);
    with no earlier token (``N = 0``) the drafter's law alone."""
    tokens = tokens.reshape(-1)
    vocab = logits.shape[-1]
    if tokens.numel() < 2:
        return torch.log_softmax(logits.float(), dim=-1)
    columns = torch.arange(vocab, device=logits.device)
    row = torch.tensor([tokens.numel() - 2], device=logits.device)  # the EAGLE-3 row whose input is x_N
    return torch.cat([pointer.mix(logits[j - 1:j], columns, tokens, row, alpha, vocab, window=window, sinks=sinks,
                                  shift=j) for j in range(1, logits.shape[0] + 1)])


def with_pointer(inner, pointer: CopyPointer, spec=None):
    """``inner`` (a ``ChainProposer`` or a ``BlockProposer``, ``calibrate.drafters.base``) with ``pointer``'s
    copies mixed into every law it drafts from, over the target's whole vocabulary (module docstring);
    ``spec`` is the spec the inner proposer runs under (None: unscaled)."""
    if isinstance(inner, BlockProposer):
        return PointerBlockProposer(inner, pointer, spec)
    if isinstance(inner, ChainProposer):
        return PointerChainProposer(inner, pointer, spec)
    raise TypeError(f"a copy pointer wraps a chain or block proposer, not {type(inner).__name__}")


def unwrap(proposer):
    """``(inner, pointer)``: the proposer a copy pointer wraps and that pointer, or ``(proposer, None)``."""
    return (proposer.inner, proposer.pointer) if isinstance(proposer, _Pointed) else (proposer, None)


class _Pointed:
    """What both pointer proposers share: the inner proposer, its name and features, the known text; an inner
    proposer that learns (``calibrate.online``) still reads the target's laws through ``verified``."""

    def __init__(self, inner, pointer: CopyPointer, spec=None):
        self.inner, self.pointer, self.spec = inner, pointer, spec
        self.name, self.feature_ids = inner.name, inner.feature_ids  # records what drafts, as without a pointer
        self.tokens: list[int] = []  # x_0 .. x_N, the known text the copies come from
        if hasattr(inner, "verified"):
            self.verified = inner.verified

    def start(self, prompt: torch.Tensor, features, pending: int) -> None:
        self.inner.start(prompt, features, pending)
        self.tokens = prompt[0].tolist() + [int(pending)]

    def commit(self, new: list[int], features) -> None:
        self.inner.commit(new, features)
        self.tokens.extend(int(x) for x in new)

    def close(self) -> None:
        self.inner.close()


class PointerBlockProposer(_Pointed):
    """A ``BlockProposer`` with a copy pointer: its rows mixed at once (:func:`spec_block_mix`), row ``j``
    copying the token ``j`` places after a match of the known text."""

    def draft_logits(self, k: int) -> torch.Tensor:
        """The inner rows (r, vocab) with the copies mixed in: log laws over the target vocabulary."""
        logits = self.inner.draft_logits(k)
        return spec_block_mix(self.pointer, logits, torch.tensor(self.tokens, device=logits.device), self.spec)

    def propose(self, k: int, rule) -> tuple[list[int], np.ndarray | None]:
        return pick_rows(self.draft_logits(k), rule)


class PointerChainProposer(_Pointed):
    """A ``ChainProposer`` with a copy pointer: each row's law mixed before its token is picked
    (:meth:`CopyPointer.mix`, the row knowing the drafts before it), with the spec's factor for the row's
    visible keys under the narrower of the spec's and the drafter's window."""

    def propose(self, k: int, rule) -> tuple[list[int], np.ndarray | None]:
        """``k`` drafts (target ids) picked by ``rule`` from the mixed laws, and those laws (None: greedy)."""
        drafts, laws = [], []
        for _ in range(k):
            token, law = rule.pick(self._row(drafts))
            drafts.append(int(token))
            if law is not None:
                laws.append(law)
        return drafts, (np.stack(laws) if laws else None)

    def _row(self, drafted: list[int]) -> torch.Tensor:
        """The log law (vocab,) of the chain's row after the known text and ``drafted``."""
        inner = self.inner
        logits = inner.row_logits(drafted)
        tokens = self.tokens + drafted  # the row's known text ends x_{row+1}
        row = len(tokens) - 2
        keys = limits(self.spec, inner.sliding_window)
        n = int(causal_mask(1, row, sliding_window=keys["window"], sinks=keys["sinks"]).sum())
        return self.pointer.mix(logits[None], inner.columns, torch.tensor(tokens, device=logits.device),
                                torch.tensor([row]), alpha(self.spec, n), inner.vocab_size, **keys)[0]


def limits(spec, sliding_window: int | None = None) -> dict:
    """The keys a pointer's row sees besides causality, as :meth:`CopyPointer.mix` takes them: the narrower of
    the drafter's own ``sliding_window`` and the spec's window, with the spec's sinks (as the drafter's attention
    has them)."""
    window = None if spec is None else spec.window
    if sliding_window is not None:
        window = sliding_window if window is None else min(window, sliding_window)
    return {"window": window, "sinks": None if spec is None or window is None else spec.sinks}


def spec_block_mix(pointer: CopyPointer, logits: torch.Tensor, tokens: torch.Tensor, spec) -> torch.Tensor:
    """:func:`block_mix` under ``spec``: its factor for the ``N`` keys before ``x_N``, its window and sinks."""
    return block_mix(pointer, logits, tokens, alpha(spec, max(tokens.numel() - 1, 1)), **limits(spec))


class PointerArm:
    """A teacher-forced arm (``calibrate.drafters.base.ForcedArm``) with ``pointer``'s copies mixed into its rows:
    the row at position ``t`` (knowing ``x_0 .. x_t`` of ``tokens``, as the EAGLE-3 row ``t - 1`` does) gets
    :meth:`CopyPointer.mix`'s law over the target's ``vocab_size`` tokens, with the spec's factor for the row's
    count and, besides causality, the keys of :func:`limits` (with the drafter's ``sliding_window``); at ``t = 0``
    there is nothing to copy from, the drafter's law alone.

    The mixed law has mass only on the inner arm's columns and on tokens of the text (what a copy brings back),
    so its rows are formed over that union, ``columns`` (sorted target ids; None where it is the whole
    vocabulary): the same law, without the columns where it is 0. The mix runs in that index space (token ids
    mapped to their column: matching compares ids, so it matches as before)."""

    def __init__(self, arm, pointer: CopyPointer, tokens: torch.Tensor, vocab_size: int,
                 sliding_window: int | None = None):
        self.arm, self.pointer, self.tokens = arm, pointer, tokens.reshape(-1)
        self.vocab_size, self.sliding_window = int(vocab_size), sliding_window
        inner = arm.columns
        support = None if inner is None else torch.unique(torch.cat((inner, self.tokens.to(inner.device))))
        if support is not None and len(support) < self.vocab_size:
            self.columns = support
            self.inner_columns = torch.searchsorted(support, inner)  # the inner rows' columns, as indices
            self.keys = torch.searchsorted(support, self.tokens.to(support.device))  # the text, as indices
        else:  # the whole vocabulary
            self.columns, self.keys, self.inner_columns = None, self.tokens, inner

    def __call__(self, spec, tap):
        keys = limits(spec, self.sliding_window)
        for part in self.arm(spec, tap):
            yield replace(part, logits=self._mix(part, spec, keys), columns=self.columns)

    def _mix(self, part, spec, keys: dict) -> torch.Tensor:
        """The log laws (r, columns) of ``part``'s rows."""
        logits = part.logits
        width = self.vocab_size if self.columns is None else len(self.columns)
        columns = (torch.arange(logits.shape[-1], device=logits.device) if self.inner_columns is None
                   else self.inner_columns)
        out = torch.full((len(logits), width), float("-inf"), device=logits.device)
        later = part.positions >= 1
        first = (~later).nonzero()[:, 0]
        if len(first):  # nothing to copy from yet: the drafter's law alone
            out[first[:, None], columns] = torch.log_softmax(logits[first].float(), -1)
        if later.any():
            out[later] = self.pointer.mix(logits[later], columns, self.keys, part.positions[later] - 1,
                                          alpha(spec, part.counts[later]), width, **keys)
        return out


def describe(pointer: CopyPointer) -> str:
    """One line for a command's notes."""
    return (f"exact match of up to {pointer.order} tokens, logit {pointer.scale:g} a token, sink {pointer.sink:g}, "
            f"gain {pointer.gain:g}" + (", rows matching nothing masked" if pointer.unmatched == "masked" else ""))


def alpha(spec, n_visible) -> torch.Tensor | float:
    """The spec's query factor for a pointer's rows with ``n_visible`` keys (an int or a 1-D tensor):
    ``alpha(n)`` of layer 0, the mean over its query heads for a per-head spec; 1 with no spec."""
    if spec is None:
        return 1.0
    from sharpdraft_runtime import alpha_for

    factors = alpha_for(spec, n_visible if isinstance(n_visible, int) else n_visible.reshape(-1), 0)
    return factors.mean(dim=1).reshape(-1)  # (rows,)


def keeping_slope(pointer: CopyPointer) -> float:
    """The log-linear slope (``alpha = 1 + slope ln(n / n_ref)``) under which a row that matches nothing keeps
    the sink's share of ``n_ref`` at every ``n > n_ref``: ``1 / sink``.

    Its ``n`` rows that match nothing carry ``n / (n + e^{alpha sink})`` of the mass, and with that slope
    ``e^{alpha sink} = e^{sink} n / n_ref``, so the share is ``n_ref / (n_ref + e^{sink})`` whatever ``n``:
    the exact correction of this attention is the fixed-slope law. (A sink at or below 0 has none.)
    """
    if not pointer.sink > 0:
        raise ValueError(f"a sink logit of {pointer.sink:g} has no keeping slope; it must be > 0")
    return 1.0 / pointer.sink


def matches(tokens: torch.Tensor, lo: int, hi: int, order: int) -> torch.Tensor:
    """``(hi - lo, hi)`` float: for query row ``t`` in ``lo .. hi - 1`` and key row ``i`` in ``0 .. hi - 1``,
    the length of the common suffix of ``x_0 .. x_i`` and ``x_0 .. x_{t+1}``, at most ``order``.

    >>> matches(torch.tensor([5, 6, 7, 5, 6, 9]), 3, 4, 2).tolist()  # row 3 knows .. 5, 6: row 1 ends 5, 6
    [[0.0, 2.0, 0.0, 0.0]]
    """
    tokens = tokens.reshape(-1)
    if tokens.numel() < hi + 1:
        raise ValueError(f"rows up to {hi - 1} need {hi + 1} tokens, got {tokens.numel()}")
    q_pos = torch.arange(lo, hi, device=tokens.device) + 1  # the query's last known token, x_{t+1}
    k_pos = torch.arange(hi, device=tokens.device)  # the key's own token, x_i
    run = torch.ones(hi - lo, hi, dtype=torch.bool, device=tokens.device)
    total = torch.zeros(hi - lo, hi, dtype=torch.float32, device=tokens.device)
    for m in range(order):
        qm, km = q_pos - m, k_pos - m
        same = tokens[qm.clamp(min=0)][:, None] == tokens[km.clamp(min=0)][None]
        run &= same & (qm >= 0)[:, None] & (km >= 0)[None]
        total += run
    return total


def read(folder: str | Path) -> tuple[CopyPointer, Path] | None:
    """The pointer in ``folder/copy_pointer.json`` and the directory of the head it joins (``"head"``,
    relative to ``folder``; absent: ``folder`` itself), or None where there is no such file.

    Raises ``UserError`` naming the file and the field for anything malformed, and for a ``"head"``
    that is not a head directory or has a pointer of its own.
    """
    folder = Path(folder)
    path = folder / FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise UserError(f"{path}: not a readable JSON file ({type(err).__name__}); restore it or remove it") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UserError(f"{path}: not a copy pointer (expected an object with \"format\": \"{FORMAT}\")")
    if data.get("version") != 1:
        raise UserError(f"{path}: version {data.get('version')!r} is not supported (this toolkit reads version 1)")
    fields = {k: data[k] for k in ("order", "scale", "sink", "gain", "unmatched") if k in data}
    try:
        pointer = CopyPointer(**fields)
    except ValueError as err:
        raise UserError(f"{path}: {err}") from None
    head = data.get("head")
    if head is None:
        return pointer, folder
    if not isinstance(head, str) or not head:
        raise UserError(f"{path}: \"head\" must be a directory name, got {head!r}")
    base = (folder / head).resolve()
    if not (base / "config.json").is_file():
        raise UserError(f"{path}: \"head\" {head!r} is not a head directory (no {base / 'config.json'})")
    if (base / FILE).is_file():
        raise UserError(f"{path}: \"head\" {head!r} has a copy pointer of its own; name a plain head")
    return pointer, base


def locate(folder: str | Path) -> tuple[CopyPointer | None, Path]:
    """The pointer in ``folder`` (None without one) and the folder whose weights to load: the head the pointer
    names, else ``folder`` itself (:func:`read`'s errors)."""
    found = read(folder)
    return (None, Path(folder)) if found is None else found


def check_unmatched(rule: str | None, folder: str | Path | None) -> str | None:
    """``--pointer-unmatched RULE`` for the drafter at ``folder``, before any model loads: None (the pointer as its
    file says), or one of :data:`UNMATCHED` for a folder with a copy pointer; ``UserError`` in one line otherwise."""
    if rule is None:
        return None
    if rule not in UNMATCHED:
        raise UserError(f"--pointer-unmatched {rule}: expected {' or '.join(UNMATCHED)} (scored: a row matching "
                        "nothing is a key of logit 0; masked: it is no key)")
    if folder is None or not Path(folder).is_dir() or read(folder) is None:
        raise UserError(f"--pointer-unmatched {rule}: the drafter {folder or '(the kind default)'} has no copy pointer "
                        f"({FILE}); name a folder with one, e.g. calibrate/assets/eagle3-smollm2-copy, or drop the option")
    return rule


def set_unmatched(adapter, rule: str | None) -> None:
    """Give the loaded ``adapter``'s copy pointer the rule ``rule`` for rows matching nothing (None: leave it), its
    notes saying so; the pointer's other numbers as its file has them."""
    if rule is None:
        return
    old = getattr(adapter, "pointer", None)
    if old is None:
        raise ValueError(f"{type(adapter).__name__} has no copy pointer to set rows matching nothing on")
    adapter.pointer = replace(old, unmatched=rule)
    if hasattr(adapter, "notes"):
        adapter.notes = [note.replace(describe(old), describe(adapter.pointer)) for note in adapter.notes]


def write(folder: str | Path, pointer: CopyPointer, head: str | None = None, record: dict | None = None) -> Path:
    """Write ``folder/copy_pointer.json`` atomically (``head`` relative to ``folder``, ``record`` how it was
    fitted); return its path."""
    from sharpdraft_theory.atomic import atomic_write_text

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = {"format": FORMAT, "version": 1, **pointer.to_dict()}
    if head is not None:
        data["head"] = head
    if record is not None:
        data["fitted"] = record
    path = folder / FILE
    atomic_write_text(path, json.dumps(data, indent=1) + "\n")
    return path
