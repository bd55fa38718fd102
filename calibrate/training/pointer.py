"""Fit a copy pointer's four numbers for an EAGLE-3 or DFlash head (``calibrate.drafters.pointer``) and write it.

On training-split text only (recall sequences, whose rows inside a repeat can be copied, and plain text,
where a pointer must not get in the way), the target and the head run once per sequence; then every
point of a grid of (order, scale, sink, gain) mixes the pointer into the head's law, and the best point
wins. Each corpus counts equally.

* EAGLE-3 (``--drafter eagle3``): the highest teacher-forced greedy agreement over all rows (ties: the
  higher expected acceptance at T = 1).
* DFlash (``--drafter dflash``): blocks at ``--anchors`` evenly spaced positions of each sequence, drafted
  as the speculative loop drafts them (``calibrate.measure.blocks``), row ``j`` copying the token ``j``
  places after a match; the highest mean accepted length of a block (its leading drafts equal to the
  target's greedy tokens along the true text; ties: the expected accepted length at T = 1). A block's
  later rows are what set it apart from a chain, so its first row's agreement is not the rule.

The pointer is written to ``OUT/copy_pointer.json`` with ``"head"`` naming the head's folder relative to
OUT, and the whole grid's figures in its ``"fitted"`` record.

Usage::

    python scripts/fit_copy_pointer.py calibrate/assets/eagle3-smollm2 --out calibrate/assets/eagle3-smollm2-copy
    python scripts/fit_copy_pointer.py calibrate/assets/dflash-smollm2 --drafter dflash \
        --out calibrate/assets/dflash-smollm2-copy
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from pathlib import Path

import numpy as np
import torch

from ..corpus import pack, recall_corpus
from ..drafters import load_drafter
from ..drafters.pointer import FILE, MAX_ORDER, UNMATCHED, CopyPointer, describe, spec_block_mix, write
from ..errors import UserError
from ..measure.blocks import block_anchors, proposed, target_along
from ..measure.metrics import NextTokenLaw

ORDERS, SCALES, SINKS, GAINS = (1, 2, 3), (2.0, 4.0, 8.0, 16.0), (0.5, 1.0, 1.5, 2.0, 2.5), (0.5, 0.8, 1.0)


def floats(text: str, name: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"--{name} {text!r}: give comma-separated numbers") from None
    if not values or not all(np.isfinite(values)):
        raise SystemExit(f"--{name} {text!r}: give finite numbers")
    return values


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("head", type=Path, help="the head folder (EAGLE-3, or DFlash with --drafter dflash)")
    ap.add_argument("--drafter", default="eagle3",
                    help="the head's kind: eagle3 (fitted by agreement) or dflash (by a block's accepted length)")
    ap.add_argument("--anchors", type=int, default=48, help="dflash: blocks per sequence, evenly spaced")
    ap.add_argument("--out", type=Path, required=True, help="folder for copy_pointer.json (not the head's own)")
    ap.add_argument("--target-path", default=None, help="the target (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--corpora", default="recall:stdlib,stdlib", help="training-split corpora, comma-separated")
    ap.add_argument("--sequences", type=int, default=12, help="sequences per corpus")
    ap.add_argument("--length", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--orders", default=",".join(map(str, ORDERS)))
    ap.add_argument("--scales", default=",".join(map(str, SCALES)))
    ap.add_argument("--sinks", default=",".join(map(str, SINKS)), help="sink logits as multiples of the scale")
    ap.add_argument("--gains", default=",".join(map(str, GAINS)))
    ap.add_argument("--unmatched", default="scored", help="a row that matches nothing: scored (a key of logit 0, "
                                                            "the shipped pointers) or masked (no key: prompt "
                                                            "lookup's rule, which does not dilute)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.drafter not in ("eagle3", "dflash"):
        raise SystemExit(f"--drafter {args.drafter}: give eagle3 or dflash (a pointer is fitted to one of those heads)")
    for name, least in (("sequences", 1), ("threads", 1), ("length", 8), ("anchors", 1)):
        if getattr(args, name) < least:
            raise SystemExit(f"--{name} {getattr(args, name)}: give an integer >= {least}")
    if not (args.head / "config.json").is_file():
        raise SystemExit(f"{args.head}: no config.json there; give a head folder")
    if args.out.resolve() == args.head.resolve() or (args.out / FILE).exists():
        raise SystemExit(f"--out {args.out}: give a new folder (not the head's own, and holding no {FILE})")
    args.orders = tuple(int(v) for v in floats(args.orders, "orders"))
    if not all(1 <= o <= MAX_ORDER for o in args.orders):
        raise SystemExit(f"--orders: give integers from 1 to {MAX_ORDER}")
    args.scales, args.sinks, args.gains = (floats(args.scales, "scales"), floats(args.sinks, "sinks"),
                                           floats(args.gains, "gains"))
    if args.unmatched not in UNMATCHED:
        raise SystemExit(f"--unmatched {args.unmatched}: give {' or '.join(UNMATCHED)}")
    try:
        [CopyPointer(o, s, s * r, g, args.unmatched) for o, s, r, g in itertools.product(args.orders, args.scales,
                                                                                          args.sinks, args.gains)]
    except ValueError as err:
        raise SystemExit(f"a grid point is not a pointer: {err}") from None
    args.corpora = [c for c in args.corpora.split(",") if c]
    if not args.corpora or any(c.endswith(":heldout") for c in args.corpora):
        raise SystemExit(f"--corpora: give training-split corpora (no ':heldout'), got {args.corpora}")
    return args


@torch.no_grad()
def sequence_scores(drafter, ids: list[int], grid: list[CopyPointer]) -> np.ndarray:
    """(points, 2): per grid point, the sums over rows of greedy agreement and expected acceptance (T = 1)."""
    input_ids = torch.tensor([ids], device=drafter.device)
    features, final = drafter.target_states(input_ids)
    law = NextTokenLaw(drafter.target.get_output_embeddings()(final), 1.0)
    head = drafter.head
    logits = head(input_ids[:, 1:], features[:, :-1]).logits[0]  # (T - 1, draft)
    columns = head.draft_to_target(torch.arange(head.config.draft_vocab_size))
    rows = torch.arange(logits.shape[0])
    out = np.zeros((len(grid), 2))
    for i, pointer in enumerate(grid):
        mixed = pointer.mix(logits, columns, input_ids[0], rows, 1.0, head.config.vocab_size,
                            window=head.config.sliding_window)
        out[i] = float((mixed.argmax(-1) == law.greedy).sum()), float(law.acceptance(mixed).sum())
    return out


@torch.no_grad()
def block_scores(drafter, ids: list[int], grid: list[CopyPointer], anchors: int) -> tuple[np.ndarray, int]:
    """(points, 2): per grid point, the sums over blocks of the greedy accepted length and the expected accepted
    length at T = 1 (``calibrate.measure.blocks``), blocks at ``anchors`` evenly spaced positions of ``ids``;
    and the count of blocks."""
    draft = drafter.block_size - 1
    at, _ = block_anchors(np.array([len(ids)]), len(ids), draft, anchors)
    input_ids = torch.tensor([ids], device=drafter.device)
    features, law, greedy = target_along(drafter, input_ids, at, draft)
    logits = proposed(drafter, None, input_ids, features, at, draft)  # (A, K, vocab): the head alone
    out = np.zeros((len(grid), 2))
    for i, pointer in enumerate(grid):
        mixed = torch.stack([spec_block_mix(pointer, rows, input_ids[0, :p + 1], None)
                             for rows, p in zip(logits, at.tolist())])
        hits = (mixed.argmax(-1) == greedy).double()
        accept = law.acceptance(mixed.flatten(0, 1)).view(len(at), draft).double()
        out[i] = float(hits.cumprod(1).sum()), float(accept.cumprod(1).sum())
    return out, len(at)


def main(argv=None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    try:
        drafter = load_drafter(args.drafter, str(args.head), args.target_path, torch.device("cpu"), torch.float32)
    except UserError as err:  # e.g. a DFlash head without --drafter dflash: one line, no traceback
        raise SystemExit(f"error: {err} (--drafter {args.drafter})") from None
    if drafter.pointer is not None:
        raise SystemExit(f"{args.head}: this head has a copy pointer already; give the plain head")
    grid = [CopyPointer(o, s, s * r, g, args.unmatched)
            for o, s, r, g in itertools.product(args.orders, args.scales, args.sinks, args.gains)]
    grid.insert(0, CopyPointer(1, 1.0, 0.0, 0.0, args.unmatched))  # gain 0: the head alone, the baseline
    tokenize = drafter.tokenize
    per_corpus = {}
    start = time.time()
    for corpus in args.corpora:
        if corpus.startswith("recall:"):
            texts = [s.ids for s in recall_corpus(corpus, tokenize, drafter.eos_token_id, args.length,
                                                  args.sequences)]
        else:
            texts = list(pack(corpus, tokenize, drafter.eos_token_id, args.length, args.sequences))
        total, count = np.zeros((len(grid), 2)), 0
        for j, ids in enumerate(texts):
            if args.drafter == "dflash":
                scores, blocks = block_scores(drafter, ids, grid, args.anchors)
            else:
                scores, blocks = sequence_scores(drafter, ids, grid), args.length - 1
            total += scores
            count += blocks
            print(f"{corpus}: sequence {j + 1}/{len(texts)} ({time.time() - start:.0f} s)", flush=True)
        per_corpus[corpus] = total / count
    score = np.mean([v for v in per_corpus.values()], axis=0)  # (points, 2)
    best = max(range(len(grid)), key=lambda i: (score[i, 0], score[i, 1]))
    chosen = grid[best]
    names = ("accepted_length", "expected_accepted_length") if args.drafter == "dflash" else (
        "agreement", "expected_acceptance")
    table = [{"order": p.order, "scale": p.scale, "sink": p.sink, "gain": p.gain,
              **{c: {names[0]: round(float(v[i, 0]), 4), names[1]: round(float(v[i, 1]), 4)}
                 for c, v in per_corpus.items()}} for i, p in enumerate(grid)]
    rule = ("highest mean greedy accepted length of a block over the corpora (ties: expected accepted length at "
            "T = 1)" if args.drafter == "dflash" else
            "highest mean greedy agreement over the corpora (ties: expected acceptance at T = 1)")
    record = {"drafter": args.drafter, "unmatched": args.unmatched, "corpora": args.corpora,
              "sequences": args.sequences, "length": args.length,
              **({"anchors": args.anchors} if args.drafter == "dflash" else {}),
              "rule": rule, "head_alone": table[0], "grid": table[1:]}
    head = os.path.relpath(args.head.resolve(), args.out.resolve())
    path = write(args.out, chosen, head=head, record=record)
    for c, v in per_corpus.items():
        print(f"{c}: head alone {names[0].replace('_', ' ')} {v[0, 0]:.4f}, {names[1].replace('_', ' ')} "
              f"{v[0, 1]:.4f}; with the pointer {v[best, 0]:.4f}, {v[best, 1]:.4f}")
    print(f"chosen: {describe(chosen)} -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
