"""Milliseconds a token of the decoding loop: target-only and speculative, at 256, 2,048 and 8,192 tokens of context.

Run ``python benchmarks/bench_decode.py`` (``--help`` for options). It prints one table and writes
nothing. The built-in target (SmolLM2-135M-Instruct, float32) prefills a held-out prompt of each
length once (``stdlib:heldout``, its first sequence cut to ``n`` tokens); then target-only greedy
decoding and speculative decoding with the demo EAGLE-3 head, alone and with its copy pointer
(``calibrate/assets/eagle3-smollm2`` and ``-copy``), decode ``--new-tokens`` tokens from copies of that
prefill, the arms alternated run by run (``--reps`` rounds, the order rotated each round), so that
a slow spell of the machine falls on every arm alike. Per arm: the median over rounds of decode time
per decoded token (the prefill excluded), the ratio to target-only in the same round (median over
rounds), and the acceptance length.

vLLM's own decoding step, where its CPU build is installed, is measured by ``bench_vllm.py``.
"""

from __future__ import annotations

import argparse
import statistics

import torch


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="256,2048,8192", help="context lengths (default 256,2048,8192)")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens decoded per run (default 32)")
    ap.add_argument("--reps", type=int, default=3, help="alternated rounds per length (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    if min(lengths) < 2 or args.new_tokens < 2 or args.reps < 1 or args.threads < 1:
        ap.error("need lengths >= 2, --new-tokens >= 2, --reps >= 1, --threads >= 1")
    torch.set_num_threads(args.threads)

    from calibrate.corpus import pack
    from calibrate.drafters import load_drafter
    from calibrate.speculative import GREEDY, prefill, speculative_generate, target_generate

    cpu = torch.device("cpu")
    head = load_drafter("eagle3", None, None, cpu, torch.float32)
    copy = load_drafter("eagle3", "calibrate/assets/eagle3-smollm2-copy", None, cpu, torch.float32)
    target = head.target
    text = next(pack("stdlib:heldout", head.tokenize, head.eos_token_id, max(lengths) + 1, limit=1))
    feature_ids = head.feature_ids

    def arms(shared, prompt):
        def target_only():
            return target_generate(target, prompt, args.new_tokens, shared, GREEDY)

        def drafting(adapter):
            def run():
                proposer = adapter.proposer(None)
                try:
                    return speculative_generate(target, proposer, prompt, args.new_tokens, 4, shared, GREEDY)
                finally:
                    proposer.close()
            return run

        return {"target only": target_only, "head": drafting(head), "head + pointer": drafting(copy)}

    print(f"SmolLM2-135M-Instruct + demo EAGLE-3 head, greedy, {args.new_tokens} new tokens, {args.threads} "
          f"thread(s), {args.reps} alternated rounds; ms a token: median over rounds; ratio: to target only, "
          "median of same-round ratios")
    print(f"  {'context':>8s} {'arm':16s} {'ms/token':>9s} {'ratio':>6s} {'accept':>7s}")
    with torch.inference_mode():
        for n in lengths:
            prompt = torch.tensor([text[:n]])
            shared = prefill(target, prompt, feature_ids)
            runs = arms(shared, prompt)
            ms = {name: [] for name in runs}
            accept = {name: [] for name in runs}
            for r in range(args.reps):
                names = list(runs)
                for name in names[r % len(names):] + names[:r % len(names)]:  # rotate the order each round
                    out = runs[name]()
                    ms[name].append(1e3 * out.decode_seconds / out.decode_tokens)
                    accept[name].append(out.acceptance_length)
            for name in runs:
                ratio = statistics.median(a / b for a, b in zip(ms[name], ms["target only"]))
                print(f"  {n:8,d} {name:16s} {statistics.median(ms[name]):9.1f} {ratio:6.2f} "
                      f"{statistics.median(accept[name]):7.2f}")


if __name__ == "__main__":
    main()
