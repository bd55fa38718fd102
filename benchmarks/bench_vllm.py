"""Acceptance length and speed in vLLM (CPU build) with none / spec / window on the drafter, and the plugin's cost.

Prompts as ``sharpdraft eval --speculative`` makes them, so the two can be set side by side: ``--sequences``
sequences of the longest length packed from ``--corpus`` with the drafter's tokenizer, and for each length
``n`` the first ``n - new_tokens`` tokens of each. One engine per arm (``benchmarks/vllm_engine.py`` in
``.venv-vllm``: vLLM spawns processes), each decoding every prompt greedily ``--rounds`` times:

* ``none``: no ``SHARPDRAFT_SPEC`` (the plugin does nothing);
* ``spec``: the exported folder's spec;
* ``window``: law constant, slope 0, window ``--window`` (default: the spec's n_ref), as eval's window;
* ``cost``: log-linear with slope 1e-9 from n_ref 16: the plugin does all its work on every drafter call
  (counts, factors, the in-place product) but every factor rounds to 1.0 in float32, so the drafts are
  those of ``none``. This engine decodes each prompt ``--rounds`` more times, twice a round, once through
  the plugin and once through vLLM's own kernel, switched in the worker between the two calls (in
  alternating order): the plugin's cost is the median of the paired ratios of seconds, under the same load.

Acceptance length per arm and length: per prompt 1 + accepted / drafts from vLLM's ``spec_decode`` counters
(the first round's; greedy: a repeat drafts the same), averaged over the prompts as eval averages its. Speed, from the paired rounds, whose prompts
vLLM's prefix cache holds (so they time decoding, with hardly any prefill): new tokens over the mean
seconds of a ``generate`` call with and without the plugin. Writes ``--out`` (JSON) and prints a table.

    python benchmarks/bench_vllm.py --export out/vllm --lengths 256,1024,4096 --sequences 2 --out out/bench_vllm.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
ENGINE_PY = ROOT / ".venv-vllm" / "bin" / "python"
ARMS = ("none", "spec", "window", "cost")


def _prompts(corpus: str, lengths: list[int], sequences: int, new_tokens: int) -> list[list[int]]:
    import torch

    from calibrate.corpus import pack
    from calibrate.drafters import load_drafter

    drafter = load_drafter("eagle3", None, None, torch.device("cpu"), torch.float32)
    texts = list(pack(corpus, drafter.tokenize, drafter.eos_token_id, max(lengths), sequences))
    return [text[:max(n - new_tokens, 2)] for n in lengths for text in texts]


def _arm_spec(arm: str, export: Path, window: int | None, folder: Path) -> str | None:
    if arm == "none":
        return None
    spec = json.loads((export / "spec.json").read_text())
    if arm == "spec":
        return str(export / "spec.json")
    body = ({"law": "constant", "n_ref": None, "slope": 0.0, "top_k": spec["top_k"], "window": window or spec["n_ref"]}
            if arm == "window" else {"law": "log-linear", "n_ref": 16, "slope": 1e-9, "top_k": 4})
    path = folder / f"{arm}.json"
    path.write_text(json.dumps(body))
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", type=Path, required=True, help="folder of `sharpdraft export ... --spec`")
    parser.add_argument("--corpus", default="stdlib:heldout")
    parser.add_argument("--lengths", default="256,1024,4096")
    parser.add_argument("--sequences", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6, help="paired rounds of the cost arm")
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    folder = Path(tempfile.mkdtemp(prefix="bench_vllm."))
    prompts = _prompts(args.corpus, lengths, args.sequences, args.new_tokens)
    (folder / "prompts.json").write_text(json.dumps(prompts))
    results = {}
    for arm in args.arms.split(","):
        env = {k: v for k, v in os.environ.items() if k not in ("SHARPDRAFT_SPEC", "PYTHONPATH")}
        spec = _arm_spec(arm, args.export, args.window, folder)
        env.update({"VLLM_CPU_KVCACHE_SPACE": "2", **({"SHARPDRAFT_SPEC": spec} if spec else {})})
        paired = ["--repeat", str(1 + args.rounds), "--pair-plugin"] if arm == "cost" else []
        env.update({"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"} if paired else {})
        subprocess.run([str(ENGINE_PY), str(ROOT / "benchmarks" / "vllm_engine.py"), "--export", str(args.export),
                        "--prompts", str(folder / "prompts.json"), "--new-tokens", str(args.new_tokens), *paired,
                        "--out", str(folder / f"{arm}.out.json")], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        results[arm] = json.loads((folder / f"{arm}.out.json").read_text())
    table = _table(results, lengths, args.sequences, args.new_tokens)
    everything = [r for r in results.get("cost", {"runs": []})["runs"] if r["plugin"] is not None]
    if everything:  # every pair, all lengths: (round, prompt) -> seconds with and without
        pairs = {}
        for r in everything:
            pairs.setdefault((r["round"], r["prompt"]), {})[r["plugin"]] = r["seconds"]
        table.append({"n": "all", "arm": "cost", "pairs": len(pairs),
                      "cost_ratio": round(float(np.median([p[True] / p[False] for p in pairs.values()])), 3)})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": vars(args) | {"export": str(args.export), "out": str(args.out)},
                                    "table": table, "runs": results}, indent=1))
    for row in table:
        print(" | ".join(f"{k}={v}" for k, v in row.items()))


def _table(results: dict, lengths: list[int], sequences: int, new_tokens: int) -> list[dict]:
    """Per length and arm: acceptance length, the outputs' agreement with none's; for cost, the paired speeds."""
    rows = []
    for li, n in enumerate(lengths):
        picked = range(li * sequences, (li + 1) * sequences)
        base = {r["prompt"]: r["output"] for r in results.get("none", {"runs": []})["runs"] if r["round"] == 0}
        for arm, result in results.items():
            runs = [r for r in result["runs"] if r["prompt"] in picked]
            first = [r for r in runs if r["round"] == 0]
            drafts, accepted = ([r["counters"].get(f"vllm:spec_decode_num_{k}", 0) for r in first]
                                for k in ("drafts", "accepted_tokens"))
            per_prompt = [1 + a / d for a, d in zip(accepted, drafts) if d]  # eval's: the mean of the prompts' values
            row = {"n": n, "arm": arm, "acceptance_length": round(float(np.mean(per_prompt)), 4) if per_prompt else None,
                   "drafts": sum(drafts), "accepted": sum(accepted),
                   "output_as_none": all(base.get(r["prompt"], r["output"]) == r["output"] for r in runs)}
            on, off = ([r["seconds"] for r in runs if r["plugin"] is flag] for flag in (True, False))
            if on:
                row.update(tokens_per_s_plugin=round(new_tokens * len(on) / sum(on), 2),
                           tokens_per_s_stock=round(new_tokens * len(off) / sum(off), 2),
                           cost_ratio=round(float(np.median(np.divide(on, off))), 3), pairs=len(on))
            rows.append(row)
    return rows

if __name__ == "__main__":
    main()
