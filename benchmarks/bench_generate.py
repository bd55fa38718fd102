"""Generation's cache: a decoding step of the built-in target through transformers' ``generate`` with its
default cache (grown by concatenation at each step) against a static cache (allocated once), in one run.

``sharpdraft generate`` decodes with the static cache (:mod:`calibrate.generate`). The script gives a
batch of ``--batch`` sequences of ``--context`` random tokens, times a one-token generation (the prefill)
and a ``--steps``-token one for each cache, and prints each cache's time a step (after the prefill) and
the ratio default / static. Both see the same machine load only roughly (they run one after the other):
read the ratio, not the seconds, and run it on a quiet machine.

    python benchmarks/bench_generate.py --batch 16 --context 2048 --steps 24 --threads 1
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=2048, help="tokens of each sequence before decoding")
    parser.add_argument("--steps", type=int, default=24, help="tokens decoded after the prefill")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if min(args.batch, args.context, args.steps, args.threads) < 1:
        parser.error("--batch, --context, --steps and --threads take positive integers")

    import torch

    from calibrate.drafters.target import load_target

    torch.set_num_threads(args.threads)
    model, _ = load_target(None, torch.device("cpu"), torch.float32)
    ids = torch.randint(100, 40000, (args.batch, args.context), generator=torch.Generator().manual_seed(0))
    per_step = {}
    for name, extra in (("default", {}), ("static", {"cache_implementation": "static"})):
        seconds = []
        for new in (1, args.steps + 1):
            start = time.perf_counter()
            with torch.inference_mode():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                               min_new_tokens=new, do_sample=False, pad_token_id=0, **extra)
            seconds.append(time.perf_counter() - start)
        per_step[name] = (seconds[1] - seconds[0]) / args.steps
        print(f"{name:8s} cache: prefill {seconds[0]:.2f} s, {per_step[name]:.3f} s a step "
              f"(batch {args.batch}, context {args.context}, {args.threads} thread(s))", flush=True)
    print(f"default / static: {per_step['default'] / per_step['static']:.2f}")


if __name__ == "__main__":
    main()
