"""Give a DFlash head a draft vocabulary: the ``--size`` most frequent tokens of its training text.

A DFlash head drafts through the target's output head, which for SmolLM2 is a 49,152 x 576 matrix: on a
CPU, reading it for the 4 rows of a block is most of a drafting forward. With a draft vocabulary
(``draft_vocab_size`` in ``config.json`` and EAGLE-3's ``d2t`` map in ``model.safetensors``) only its rows
run (``DFlashDraftModel.compute_logits``) and every other token gets ``-inf``: a greedy draft changes only
where the whole vocabulary's argmax lies outside it, and speculative sampling stays exact (the drafts'
laws are zero there). The head's trained weights are copied unchanged.

Usage::

    python scripts/dflash_draft_vocab.py .cache/heads/dflash-b5 \\
        --features .cache/smollm2-features-recall-1024 --size 4096 --out .cache/heads/dflash-b5-v4096

``--features`` are the shard folders the head trained on (``scripts/target_features.py``; only their
tokens are read). ``--out`` must not exist: the folder is written whole, then renamed into place.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import torch

from ..drafters.vocab import d2t_of, draft_vocabulary
from ..errors import UserError
from .common import atomic_folder


def read_tokens(folders: list[Path]) -> torch.Tensor:
    """Every token of the shard folders, flattened: only each shard's ``tokens`` are kept."""
    parts = []
    for folder in folders:
        manifest = json.loads((folder / "manifest.json").read_text())
        parts += [torch.load(folder / f"seq-{i:05d}.pt", weights_only=True)["tokens"].flatten()
                  for i in range(manifest["sequences"])]
    return torch.cat(parts)


def check(args) -> tuple[dict, list[Path]]:
    """The head's config.json, and the feature folders; SystemExit naming the value on any bad input."""
    from ..drafters.dflash import DFlashConfig

    if not (args.head / "config.json").is_file() or not (args.head / "model.safetensors").is_file():
        raise SystemExit(f"{args.head}: not a DFlash head folder (config.json and model.safetensors)")
    try:
        config = DFlashConfig.from_json(args.head / "config.json")
    except UserError as e:
        raise SystemExit(str(e)) from None
    if config.source != "dflash":
        raise SystemExit(f"{args.head}: a {config.source}-layout head; a draft vocabulary is added to z-lab's layout")
    if config.draft_vocab_size is not None:
        raise SystemExit(f"{args.head} already drafts from {config.draft_vocab_size} tokens; start from a head "
                         "without a draft vocabulary")
    if not 1 <= args.size < config.vocab_size:
        raise SystemExit(f"--size {args.size}: give 1 to {config.vocab_size - 1} (the whole vocabulary needs no "
                         "draft vocabulary)")
    if args.out.exists():
        raise SystemExit(f"--out {args.out} exists; give a new folder (nothing is overwritten)")
    folders = [Path(f) for f in args.features.split(",") if f]
    missing = [str(f) for f in folders if not (f / "manifest.json").is_file()]
    if not folders or missing:
        raise SystemExit(f"--features {args.features}: {', '.join(missing) or 'no folder'} has no manifest.json; "
                         "give the shard folders of scripts/target_features.py the head trained on")
    return json.loads((args.head / "config.json").read_text()), folders


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("head", type=Path, help="a DFlash head folder in z-lab's layout (scripts/train_dflash.py)")
    ap.add_argument("--features", required=True,
                    help="shard folders the head trained on, comma-separated (their tokens are counted)")
    ap.add_argument("--size", type=int, default=4096, help="tokens in the draft vocabulary (default 4096, as the "
                                                            "EAGLE-3 heads')")
    ap.add_argument("--out", type=Path, required=True, help="the new head folder (must not exist)")
    args = ap.parse_args(argv)
    config, folders = check(args)

    from safetensors.torch import load_file, save_file

    tokens = read_tokens(folders)
    if len(tokens) == 0 or int(tokens.min()) < 0 or int(tokens.max()) >= config["vocab_size"]:
        raise SystemExit(f"--features {args.features}: their tokens are not ids of the head's vocabulary of "
                         f"{config['vocab_size']}; give the shard folders this head trained on")
    ids = draft_vocabulary(tokens, config["vocab_size"], args.size)
    coverage = torch.isin(tokens, ids).float().mean().item()
    weights = load_file(str(args.head / "model.safetensors"))
    weights["d2t"] = d2t_of(ids)
    config["draft_vocab_size"] = args.size
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_folder(args.out) as tmp:
        for name in os.listdir(args.head):
            if name not in ("config.json", "model.safetensors", "training_log.json") and (args.head / name).is_file():
                shutil.copy2(args.head / name, tmp / name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        record = {}
        if (args.head / "training_log.json").is_file():
            record = json.loads((args.head / "training_log.json").read_text())
        record["draft_vocab"] = {"size": args.size, "features": [str(f) for f in folders],
                                 "train_tokens": int(tokens.numel()), "coverage": round(coverage, 4)}
        (tmp / "training_log.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}: {args.size} draft tokens cover {coverage:.4f} of {tokens.numel()} training tokens")


if __name__ == "__main__":
    main()
