"""Acceptance length and speed in vLLM (CPU build) with none / spec / window on the drafter, and the plugin's cost.

Prompts as ``sharpdraft eval --speculative`` makes them, so the two can be set side by side: ``--sequences``
sequences of the longest length packed from ``--corpus`` with the drafter's tokenizer, and for each length
``n`` the first ``n - new_tokens`` tokens of each. One engine per arm (``benchmarks/vllm_engine.py`` in
``.venv-vllm``: vLLM spawns processes), each decoding every prompt greedily ``--rounds`` times:

* ``none``: no ``SHARPDRAFT_SPEC`` (the plugin does nothing);
* ``spec``: the exported folder's spec;
* ``window``: law constant, slope 0, window ``--window`` (default: the spec's n_ref), as eval's window;
* ``cost``: log-linear with slope 1e-9 from n_ref 16: the plugin does all its work on every drafter call
  (counts, factors, the in-place product) but every factor rounds to 1.0 in float32, so the drafts, and the
  acceptance, are those of ``none``: its time against ``none``'s is the plugin's cost.

Acceptance length per arm and length: 1 + accepted / drafts from vLLM's ``spec_decode`` counters, summed over
prompts and rounds. Speed: new tokens over the seconds of the ``generate`` calls (prefill included), per
length; the cost ratio is ``none``'s tokens/s over ``cost``'s. Writes ``--out`` (JSON) and prints a table.

    python benchmarks/bench_vllm.py --export out/vllm --lengths 256,1024,4096 --sequences 2 --out out/bench_vllm.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

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
    parser.add_argument("--rounds", type=int, default=2)
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
        subprocess.run([str(ENGINE_PY), str(ROOT / "benchmarks" / "vllm_engine.py"), "--export", str(args.export),
                        "--prompts", str(folder / "prompts.json"), "--new-tokens", str(args.new_tokens),
                        "--repeat", str(args.rounds), "--out", str(folder / f"{arm}.out.json")], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        results[arm] = json.loads((folder / f"{arm}.out.json").read_text())
    table = _table(results, lengths, args.sequences, args.new_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": vars(args) | {"export": str(args.export), "out": str(args.out)},
                                    "table": table, "runs": results}, indent=1))
    for row in table:
        print(" | ".join(f"{k}={v}" for k, v in row.items()))


def _table(results: dict, lengths: list[int], sequences: int, new_tokens: int) -> list[dict]:
    """Per length and arm: acceptance length, tokens/s, the outputs' agreement with none's."""
    rows = []
    for li, n in enumerate(lengths):
        picked = range(li * sequences, (li + 1) * sequences)
        base = {(r["round"], r["prompt"]): r["output"] for r in results.get("none", {"runs": []})["runs"]}
        for arm, result in results.items():
            runs = [r for r in result["runs"] if r["prompt"] in picked]
            drafts = sum(r["counters"].get("vllm:spec_decode_num_drafts", 0) for r in runs)
            accepted = sum(r["counters"].get("vllm:spec_decode_num_accepted_tokens", 0) for r in runs)
            seconds = sum(r["seconds"] for r in runs)
            same = all(base.get((r["round"], r["prompt"]), r["output"]) == r["output"] for r in runs)
            rows.append({"n": n, "arm": arm, "acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
                         "drafts": drafts, "accepted": accepted,
                         "tokens_per_s": round(new_tokens * len(runs) / seconds, 2), "output_as_none": same})
    return rows


if __name__ == "__main__":
    main()
