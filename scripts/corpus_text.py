"""What a generated corpus's text does, per run folder: how each generation stopped, how many end in a loop
(and its period), distinct 4-grams in the first and the last ``--bin-size`` output tokens (min, median,
max over the prompts). The figures docs/longgen.md gives for the shipped corpora.

    python scripts/corpus_text.py calibrate/assets/generated/*-sampled calibrate/assets/generated/*-greedy
"""

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's package, installed or not
from calibrate.errors import UserError  # noqa: E402
from calibrate.generate import read_generations  # noqa: E402
from calibrate.measure.longgen import looped, text_by_bin  # noqa: E402


def describe(folder: Path, bin_size: int) -> str:
    """One line on the corpus in ``folder`` (a ``sharpdraft generate`` run)."""
    runs = read_generations(folder)
    if not runs:
        raise UserError(f"{folder}: no finished generation")
    stopped = {k: sum(g.stopped == k for g in runs) for k in ("length", "end", "eos")}
    periods = [p for p in (looped(g.output_ids) for g in runs) if p is not None]
    first, last = [], []
    for g in runs:
        distinct = text_by_bin(g.output_ids, bin_size, -(-len(g.output_ids) // bin_size))["distinct_4grams"]
        first.append(distinct[0])
        last.append(distinct[-1])
    spread = lambda v: f"{np.nanmin(v):.2f}-{np.nanmax(v):.2f} (median {np.nanmedian(v):.2f})"  # noqa: E731
    tokens = [len(g.output_ids) for g in runs]
    loops = f"period {min(periods)} to {max(periods)}" if periods else "none"
    return (f"{folder.name}: {len(runs)} prompts, {min(tokens)}-{max(tokens)} tokens "
            f"({stopped['length']} to the limit, {stopped['end']} at the end marker, {stopped['eos']} ended); "
            f"{len(periods)} end in a loop ({loops}); distinct 4-grams first {bin_size} tokens {spread(first)}, "
            f"last {bin_size} {spread(last)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="sharpdraft generate run folders")
    parser.add_argument("--bin-size", type=int, default=512)
    args = parser.parse_args()
    if args.bin_size < 1:
        parser.exit(1, f"--bin-size {args.bin_size}: expected at least 1\n")
    try:
        for folder in args.folders:
            print(describe(folder, args.bin_size))
    except UserError as e:
        parser.exit(1, f"{e}\n")


if __name__ == "__main__":
    main()
