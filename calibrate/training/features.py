"""Target features for training EAGLE-3 heads: SmolLM2's hidden states over packed corpus sequences.

For each packed sequence of ``--seq-len`` tokens, SmolLM2-135M-Instruct runs once and this keeps
``hidden_states[2, 15, 27]`` (the EAGLE-3 features: low, middle and high layer inputs) and the final
normed state (the teacher: times the target's ``lm_head`` it gives the target's logits), in fp16.

The job is resumable: every sequence is one shard file ``seq-NNNNN.pt`` in ``--out``, written
atomically (temporary file, then rename), and shards already present are skipped, so an interrupted
run continues where it stopped. ``manifest.json`` records what the shards hold, and a run with other
options into the same folder is refused rather than mixed in.

Sources are taken in the order given, each packed on its own (documents joined with EOS, as
``calibrate.corpus.pack`` packs calibration and evaluation text), up to ``--tokens`` in all and
at most ``--per-source`` sequences from each (one number, or one per source). A source ``recall:X`` is the split ``X`` made into
recall sequences (``calibrate.recall``: passages recurring verbatim at distances from 48 to 7,936
tokens); its shards also hold the ``copied`` mask::

    python scripts/target_features.py --sources pydoc:train,stdlib --seq-len 8192 --tokens 524288
    python scripts/target_features.py --sources recall:pydoc:train,recall:stdlib,pydoc:train,stdlib \
        --per-source 16,16,13,51 --tokens 786432 --out .cache/smollm2-features-copy-mix

``--skip`` passes over the first sequences of each source, so a second folder continues the text of a
first (``--skip 0,220`` after ``--per-source 100,220``: the stdlib text that follows, none repeated)::

    python scripts/target_features.py --sources recall:stdlib --per-source 320 --skip 220 --seq-len 1024 \
        --tokens 327680 --out .cache/smollm2-features-recall-1024-more
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ..corpus import pack
from ..drafters.eagle3 import feature_layer_ids
from ..drafters.target import eos_token_id, hidden_state_features
from ..recall import recall_sequences
from ..smollm2 import load_smollm2
from .common import ROOT, atomic_save, check_device, log

DEFAULT_OUT = ROOT / ".cache" / "smollm2-features-8192"


def plan_sequences(tokenizer, sources: list[str], seq_len: int, tokens: int,
                   per_source: list[int] | None = None, skip: list[int] | None = None
                   ) -> list[tuple[str, list[int], list[bool] | None]]:
    """``(source, token ids, copied mask or None)`` of every sequence to featurize: each source in turn,
    ``tokens`` in all, at most ``per_source[i]`` from source ``i`` (one value: the same for each), after
    the first ``skip[i]`` sequences of source ``i`` (made and dropped: a source is consumed in order, so
    a second folder with ``skip`` = the first one's count holds the text that follows, none of the same)."""
    wanted = tokens // seq_len
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    eos = eos_token_id(tokenizer)
    planned: list[tuple[str, list[int], list[bool] | None]] = []
    caps, skips = each_source(per_source, len(sources), wanted), each_source(skip, len(sources), 0)
    for source, cap, skipped in zip(sources, caps, skips):
        left = min(wanted - len(planned), cap)
        if left <= 0:
            break
        if source.startswith("recall:"):
            stream = (t for seq in pack(source.removeprefix("recall:"), encode, eos, 1024) for t in seq)
            try:
                made = recall_sequences(stream, seq_len, skipped + left)[skipped:]
            except ValueError as e:
                raise SystemExit(f"{source}: {e} (it was asked for {left} sequences of {seq_len} after {skipped}; "
                                 "lower --tokens, --per-source or --skip)") from None
            planned += [(source, r.ids, r.copied.tolist()) for r in made]
        else:
            planned += [(source, seq, None) for seq in list(pack(source, encode, eos, seq_len, skipped + left))[skipped:]]
    return planned


def each_source(counts: list[int] | None, sources: int, default: int) -> list[int]:
    """One count per source from ``counts`` (one value: the same for each; None: ``default`` for each).

    >>> each_source([5], 3, 0), each_source([1, 2], 2, 0), each_source(None, 2, 9)
    ([5, 5, 5], [1, 2], [9, 9])
    """
    if not counts:
        return [default] * sources
    return counts * sources if len(counts) == 1 else list(counts)


def per_source_counts(text: str, sources: int, option: str = "--per-source", least: int = 1) -> list[int]:
    """``--per-source`` (or ``--skip``, ``least`` 0): one count of at least ``least``, or one per source; else a
    one-line exit."""
    try:
        counts = [int(v) for v in text.split(",")]
    except ValueError:
        counts = []
    if len(counts) not in (1, sources) or min(counts, default=least - 1) < least:
        kind = "positive" if least == 1 else "whole"
        raise SystemExit(f"{option} {text}: give one {kind} number or one per source ({sources})")
    return counts


def load_shards(folder: Path) -> dict[str, torch.Tensor]:
    """All shards of a finished run: tokens (S, T) int64, features (S, T, 3H) fp16, final (S, T, H) fp16,
    copied (S, T) bool (all False in a sequence that is not a recall sequence)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    shards = [torch.load(folder / f"seq-{i:05d}.pt", weights_only=True) for i in range(manifest["sequences"])]
    for s in shards:
        s.setdefault("copied", torch.zeros(len(s["tokens"]), dtype=torch.bool))
    return {key: torch.stack([s[key] for s in shards]) for key in ("tokens", "features", "final", "copied")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="shard folder (resumed if it exists)")
    ap.add_argument("--sources", default="pydoc:train,stdlib", help="corpora, comma-separated, in order")
    ap.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence (target context)")
    ap.add_argument("--tokens", type=int, default=524288, help="target tokens in all")
    ap.add_argument("--per-source", default=None,
                    help="at most this many sequences from each source: one number, or one per source (comma-separated)")
    ap.add_argument("--skip", default=None,
                    help="sequences of each source to pass over first (one number, or one per source): a second "
                         "folder with --skip N continues the text of a first one that took N")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="where the target runs: cpu, or cuda on a GPU machine (fp32 either "
                                                     "way, so the shards do not depend on it beyond rounding)")
    args = ap.parse_args()
    sources = args.sources.split(",")
    per_source = None if args.per_source is None else per_source_counts(args.per_source, len(sources))
    skip = None if args.skip is None else per_source_counts(args.skip, len(sources), "--skip", least=0)
    device = check_device(args.device)
    torch.set_num_threads(args.threads)

    target, tokenizer = load_smollm2(device)
    planned = plan_sequences(tokenizer, sources, args.seq_len, args.tokens, per_source, skip)
    num_layers = len(target.get_decoder().layers)
    ids = (*feature_layer_ids(num_layers), num_layers)  # the EAGLE-3 features, then the final normed state
    manifest = {"sources": sources, "seq_len": args.seq_len, "sequences": len(planned),
                "per_source": {s: sum(src == s for src, *_ in planned) for s in sources},
                "layers": list(ids), "dtype": "float16", "target": "SmolLM2-135M-Instruct (fp32)"}
    if skip and any(skip):  # recorded only when given, so folders made before --skip resume as they were
        manifest["skip"] = dict(zip(sources, each_source(skip, len(sources), 0)))
    args.out.mkdir(parents=True, exist_ok=True)
    manifest_path = args.out / "manifest.json"
    if manifest_path.is_file() and json.loads(manifest_path.read_text()) != manifest:
        raise SystemExit(f"{args.out} holds shards made with other options; use another --out")
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    log(f"{len(planned)} sequences of {args.seq_len}: {manifest['per_source']}")

    started = time.time()
    done_now = 0
    for i, (_, seq, copied) in enumerate(planned):
        shard = args.out / f"seq-{i:05d}.pt"
        if shard.is_file():
            continue
        tokens = torch.tensor([seq])
        with torch.no_grad():
            out = hidden_state_features(target, tokens.to(device), ids)[0].cpu()  # (T, 4H)
        width = out.shape[-1] // 4
        shard_data = {"tokens": tokens[0], "features": out[:, :3 * width].half().clone(),
                      "final": out[:, 3 * width:].half().clone()}
        if copied is not None:
            shard_data["copied"] = torch.tensor(copied)
        atomic_save(shard_data, shard)
        done_now += 1
        rate = (time.time() - started) / done_now
        left = sum(not (args.out / f"seq-{j:05d}.pt").is_file() for j in range(len(planned)))
        log(f"sequence {i + 1}/{len(planned)} ({rate:.0f} s each, about {left * rate / 60:.0f} min left)")
    log(f"done: {args.out}")


if __name__ == "__main__":
    main()
