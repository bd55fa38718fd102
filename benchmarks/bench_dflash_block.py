"""Cost of one DFlash block under each spec kind: the built-in head drafting over a long context.

Run ``python benchmarks/bench_dflash_block.py`` (``--help`` for options). It prints one table and
writes nothing. The built-in DFlash head (``calibrate/assets/dflash-smollm2``) drafts its block
(``DFlashBlockProposer.block_logits``, the drafts a verification reads) after a context of ``--n``
tokens (random ids; the target's features computed once), under eval's variants at its n_ref: the
scale (``spec``, slope 0.2), the window (the last n_ref keys), ``clamp`` (neighbour window n_ref)
and ``clamp+spec``. Each kind is paired with the plain block by ``bench_runtime.compare`` (the two arms
alternated call by call, the ratio the median of per-pair ratios ``kind / plain``; ``+peak`` the extra
peak memory of one call, ``kept`` what outlives it).

A distance fix on a block (``sharpdraft_runtime.positions.attention_at``) takes, on the CPU in float32, one
compiled pass over the context keys (``sharpdraft_runtime.fused.block_logits``: each key read once, a far
key rotated in a small buffer and dotted with every row and query head that share it), then one softmax
and one product with the values, where the plain block runs the fused kernel; a window attends to n_ref
keys only. ``NUMBA_DISABLE_JIT=1`` times the eager path instead (the far keys rotated into a copy, two
logit matrices merged), which CUDA, half precision and gradients take.
"""

from __future__ import annotations

import argparse

import torch
from bench_runtime import compare  # this folder: the runtime benchmark's alternated timing and memory


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=8192, help="context tokens before the block (default 8192)")
    ap.add_argument("--reps", type=int, default=20, help="alternated pairs per kind (default 20)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = ap.parse_args(argv)
    if args.n < 2 or args.reps < 1 or args.threads < 1:
        ap.error(f"--n {args.n} --reps {args.reps} --threads {args.threads}: need n >= 2, reps >= 1, threads >= 1")
    torch.set_num_threads(args.threads)

    from calibrate.drafters import load_drafter
    from calibrate.drafters.blocks import DFlashBlockProposer
    from calibrate.drafters.target import hidden_state_features
    from calibrate.eval.variants import default_spec, variant_specs

    d = load_drafter("dflash", None, None, torch.device("cpu"), torch.float32)
    n_ref = d.default_n_ref
    specs = variant_specs(default_spec(n_ref, 4), n_ref, ["spec", "window", "clamp", "clamp+spec"], longest=args.n)
    ids = torch.randint(100, 40_000, (1, args.n + 1), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        feats = hidden_state_features(d.target, ids[:, :args.n], tuple(d.model.config.hidden_state_ids))

        def drafter(spec):
            dr = DFlashBlockProposer(d.model, d.target, spec)
            dr.start(ids[:, :args.n], feats, int(ids[0, args.n]))
            return lambda: dr.block_logits(4)

        plain = drafter(None)
        cpu = torch.device("cpu")
        print(f"DFlash head, a block of {d.model.config.block_size} after {args.n:,} context tokens, n_ref {n_ref}, "
              f"{args.threads} thread(s); ratio: median of {args.reps} alternated pairs")
        print(f"  {'kind':12s} {'ratio':>6s} {'plain ms':>9s} {'+peak':>12s} {'kept':>6s}")
        for name, spec in specs.items():
            r = compare(plain, drafter(spec), args.reps, cpu)
            print(f"  {name:12s} {r['ratio']:6.2f} {r['plain_ms']:9.1f} {r['peak']:12,d} {r['kept']:6,d}")

if __name__ == "__main__":
    main()
