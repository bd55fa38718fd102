"""How often a SmolLM2 cut, untrained, agrees with SmolLM2: the case for training a PARD drafter.

A cut keeps SmolLM2's embedding, its first ``F`` decoder layers, its last ``L`` and its final norm
and LM head (``calibrate.drafters.pard_smollm2.cut_drafter``, as ``scripts/train_pard.py`` starts
from). On held-out sequences it reads the true text teacher-forced and reports, per cut, the share
of positions whose greedy next token equals SmolLM2's, with the mean, least and largest over the
sequences. Usage::

    python scripts/pard_cut_agreement.py --cuts 4+0,3+1,8+0,12+0,20+2 --sequences 12 --seq-len 256
"""

from __future__ import annotations

import argparse
import sys

import torch

from ..corpus import pack
from ..drafters.pard_smollm2 import SMOLLM2_LAYERS, cut_drafter, layers_from
from ..drafters.target import eos_token_id


def parse_cuts(text: str) -> list[tuple[int, int]]:
    """``"4+0,3+1"`` as [(4, 0), (3, 1)]: first F layers plus the last L; exits on a malformed cut."""
    cuts = []
    for item in text.split(","):
        first, plus, last = item.partition("+")
        if not (plus and first.isdigit() and last.isdigit()):
            sys.exit(f"--cuts {text}: {item!r} is not F+L (first F layers plus the last L, e.g. 3+1)")
        try:
            layers_from(int(first) + int(last), int(last), SMOLLM2_LAYERS)
        except ValueError as err:
            sys.exit(f"--cuts {text}: {err}")
        cuts.append((int(first), int(last)))
    return cuts


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cuts", default="4+0,3+1,8+0,7+1,12+0,11+1,16+2,20+2", help="F+L, comma-separated")
    ap.add_argument("--corpus", default="stdlib:heldout")
    ap.add_argument("--sequences", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    cuts = parse_cuts(args.cuts)
    if args.sequences < 1 or args.seq_len < 2:
        sys.exit("--sequences must be at least 1 and --seq-len at least 2")
    torch.set_num_threads(args.threads)
    from ..smollm2 import load_smollm2

    model, tokenizer = load_smollm2()
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    ids = torch.tensor(list(pack(args.corpus, encode, eos_token_id(tokenizer), args.seq_len, args.sequences)))
    with torch.inference_mode():
        target = model(ids).logits.argmax(-1)
        accuracy = (target[:, :-1] == ids[:, 1:]).float().mean().item()
        print(f"SmolLM2 on {len(ids)} x {args.seq_len} tokens of {args.corpus}: its greedy token is the true "
              f"next one at {accuracy:.3f} of positions")
        for first, last in cuts:
            drafter = cut_drafter(model, layers_from(first + last, last, SMOLLM2_LAYERS), 16, args.seq_len, "smollm2")
            agree = (drafter(ids).logits.argmax(-1) == target).float().mean(1)
            print(f"first {first} + last {last} layers: agreement with SmolLM2 {agree.mean():.3f} "
                  f"(sequences {agree.min():.3f} to {agree.max():.3f})")


if __name__ == "__main__":
    main()
