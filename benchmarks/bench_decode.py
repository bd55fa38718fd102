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

With ``--vllm-export DIR`` (a ``sharpdraft export`` folder; vLLM's CPU build in ``.venv-vllm``, ``make
vllm``), vLLM's own target-only decoding of the same prompts, model and thread count follows in the same
run (``benchmarks/vllm_engine.py --no-draft``, eager, its worker bound to ``--threads`` cores): ``--reps``
timed rounds after one untimed round, whose prompt vLLM's prefix cache then holds, so a round times
decoding; ms a token is the median round's seconds over the new tokens, and its ratio is to the loop's
target-only median at that length. vLLM with the drafter is measured by ``bench_vllm.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from bench_vllm import ENGINE_PY, ROOT  # this folder is on the path when a benchmark runs as a script


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="256,2048,8192", help="context lengths (default 256,2048,8192)")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens decoded per run (default 32)")
    ap.add_argument("--reps", type=int, default=3, help="alternated rounds per length (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--vllm-export", type=Path, default=None,
                    help="also time vLLM's target-only decoding of the same prompts (a sharpdraft export folder)")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    if min(lengths) < 2 or args.new_tokens < 2 or args.reps < 1 or args.threads < 1:
        ap.error("need lengths >= 2, --new-tokens >= 2, --reps >= 1, --threads >= 1")
    if args.vllm_export is not None and not (args.vllm_export / "vllm.json").is_file():
        ap.error(f"--vllm-export {args.vllm_export}: no vllm.json there; write it with `sharpdraft export`")
    if args.vllm_export is not None and not ENGINE_PY.exists():
        ap.error(f"--vllm-export: vLLM's environment {ENGINE_PY.parent.parent} is missing; run `make vllm`")
    torch.set_num_threads(args.threads)

    from calibrate.corpus import pack
    from calibrate.drafters import load_drafter
    from calibrate.speculative import GREEDY, prefill, speculative_generate, target_generate

    cpu = torch.device("cpu")
    head = load_drafter("eagle3", "calibrate/assets/eagle3-smollm2", None, cpu, torch.float32)  # the head alone
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
    target_ms = {}
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
            target_ms[n] = statistics.median(ms["target only"])
            for name in runs:
                ratio = statistics.median(a / b for a, b in zip(ms[name], ms["target only"]))
                print(f"  {n:8,d} {name:16s} {statistics.median(ms[name]):9.1f} {ratio:6.2f} "
                      f"{statistics.median(accept[name]):7.2f}")
    if args.vllm_export is not None:
        for n, seconds in _vllm_target_only(args, [text[:n] for n in lengths]).items():
            ms = 1e3 * seconds / args.new_tokens
            print(f"  {n:8,d} {'vLLM target only':16s} {ms:9.1f} {ms / target_ms[n]:6.2f} {'':>7s}")



def _vllm_target_only(args, prompts: list[list[int]]) -> dict[int, float]:
    """{prompt length: median seconds of a timed round}: vLLM decoding each prompt alone, target only."""
    folder = Path(tempfile.mkdtemp(prefix="bench_decode."))
    (folder / "prompts.json").write_text(json.dumps(prompts))
    cores = f"0-{args.threads - 1}" if args.threads > 1 else "0"
    env = {k: v for k, v in os.environ.items() if k not in ("SHARPDRAFT_SPEC", "PYTHONPATH")}
    env.update({"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": cores, "HF_HUB_OFFLINE": "1"})
    subprocess.run([str(ENGINE_PY), str(ROOT / "benchmarks" / "vllm_engine.py"), "--export", str(args.vllm_export),
                    "--prompts", str(folder / "prompts.json"), "--new-tokens", str(args.new_tokens), "--no-draft",
                    "--repeat", str(1 + args.reps), "--out", str(folder / "out.json")], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs = json.loads((folder / "out.json").read_text())["runs"]
    return {len(p): statistics.median(r["seconds"] for r in runs if r["prompt"] == i and r["round"] > 0)
            for i, p in enumerate(prompts)}


if __name__ == "__main__":
    main()
