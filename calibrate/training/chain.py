"""Teacher-forced agreement of EAGLE-3 heads at every step of their drafting chain, paired over sequences.

``sharpdraft eval`` reports a head's first drafting step teacher-forced and its whole chain only
through speculative decoding (acceptance length, from few prompts). This runs the chain itself
along the true text, as the training-time test does (the head's own ``Eagle3Head.unrolled``, which
training and drafting share, tested equal to the chain drafter): at every row, step ``s`` drafts the
token ``s`` places later from the head's own hidden state after ``s`` true tokens, and agrees when it
is the target's greedy token there. Each head's agreement per step is a mean over sequences with a
95% bootstrap interval over sequences; every head after the first is paired with the first on the
same rows.

Usage::

    python scripts/chain_agreement.py calibrate/assets/eagle3-smollm2 .cache/heads/other \\
        --corpus recall:pydoc:heldout --sequences 8 --length 256 --steps 4
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

RESAMPLES = 2000


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("heads", nargs="+", type=Path, help="EAGLE-3 head folders (the first is the one others pair with)")
    ap.add_argument("--target-path", default=None, help="the target (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--corpus", default="stdlib:heldout", help="the text (eval's --corpus names)")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--length", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--steps", type=int, default=4, help="drafting steps of the chain")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    for name, least in (("sequences", 1), ("steps", 1), ("threads", 1)):
        if getattr(args, name) < least:
            raise SystemExit(f"--{name} {getattr(args, name)}: give an integer >= {least}")
    if args.length < args.steps + 2:
        raise SystemExit(f"--length {args.length}: give at least --steps + 2 ({args.steps + 2}) tokens")
    for head in args.heads:
        if not (head / "config.json").is_file():
            raise SystemExit(f"{head}: no config.json there; give EAGLE-3 head folders")
    return args


@torch.no_grad()
def chain_agreement(drafter, input_ids: torch.Tensor, steps: int, states=None) -> np.ndarray:
    """(steps,): the share of rows whose chain step ``s`` drafts the target's greedy token, along ``input_ids``
    (1, T); rows whose step ``steps - 1`` still lies in the text (``T - steps`` of them). ``states``: the
    target's pass over the text (``drafter.target_states``) when the caller already has it."""
    # (1, T, 3H); (T - 1, H): the target's law for row t at t
    features, final = drafter.target_states(input_ids) if states is None else states
    rows = input_ids.shape[1] - steps
    head = drafter.head
    pos = torch.arange(rows, device=input_ids.device)[None]
    logits = head.unrolled(features[:, :rows], input_ids[:, 1:rows + steps], pos, steps, chunk=64)
    lm_head = drafter.target.get_output_embeddings()
    out = np.empty(steps)
    for s, step in enumerate(logits):
        drafted = head.draft_to_target(step[0].argmax(-1))
        greedy = lm_head(final[s:s + rows]).argmax(-1)
        out[s] = (drafted == greedy).float().mean().item()
    return out


def interval(values: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """95% bootstrap interval of the mean over sequences (axis 0), per column."""
    means = np.stack([values[rng.integers(0, len(values), len(values))].mean(0) for _ in range(RESAMPLES)])
    return np.percentile(means, 2.5, axis=0), np.percentile(means, 97.5, axis=0)


def main(argv=None) -> None:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    from ..corpus import pack
    from ..drafters import load_drafter
    from ..drafters.target import eos_token_id
    from ..errors import UserError

    per_head = []
    texts = None
    passes = {}  # the target's pass over each text, per feature layers: heads reading the same layers share it
    for head in args.heads:
        try:
            drafter = load_drafter("eagle3", str(head), args.target_path, torch.device("cpu"), torch.float32)
            if texts is None:
                encode = lambda text: drafter.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
                texts = list(pack(args.corpus, encode, eos_token_id(drafter.tokenizer), args.length, args.sequences))
                if len(texts) < args.sequences:
                    raise SystemExit(f"--corpus {args.corpus}: {len(texts)} sequences of {args.length} tokens, not "
                                     f"{args.sequences}; ask for fewer or shorter")
        except UserError as err:
            raise SystemExit(str(err).replace("--max-length", "--length")) from None
        rows = []
        for i, text in enumerate(texts):
            ids = torch.tensor([text])
            key = (tuple(drafter.feature_ids), i)
            if key not in passes:
                passes[key] = drafter.target_states(ids)
            rows.append(chain_agreement(drafter, ids, args.steps, passes[key]))
        per_head.append(np.stack(rows))
    rng = np.random.default_rng(0)
    print(f"{args.sequences} sequences of {args.length} tokens of {args.corpus}; teacher-forced chain agreement per "
          f"step, 95% interval over sequences; differences paired with {args.heads[0]} (bold: excludes 0)\n")
    print("| head | " + " | ".join(f"step {s + 1}" for s in range(args.steps)) + " |")
    print("|---|" + "---|" * args.steps)
    for i, (head, values) in enumerate(zip(args.heads, per_head)):
        lo, hi = interval(values, rng)
        cells = [f"{m:.3f} [{a:.3f}, {b:.3f}]" for m, a, b in zip(values.mean(0), lo, hi)]
        if i:
            d = values - per_head[0]
            dlo, dhi = interval(d, rng)
            cells = [c + (" (**{:+.3f} [{:+.3f}, {:+.3f}]**)" if a > 0 or b < 0 else " ({:+.3f} [{:+.3f}, {:+.3f}])")
                     .format(m, a, b) for c, m, a, b in zip(cells, d.mean(0), dlo, dhi)]
        print(f"| {head} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
