"""Training text written by the target itself: prompts from the training splits, continued by SmolLM2.

A drafter is judged by how often the target accepts its drafts, so the text that teaches it best is
the target's own: where the target would write something else than the corpus, the corpus teaches a
token the target will never verify. Text sampled from the target also has no end, where the
training splits run out (the PARD drafter saw each of its 2,275 sequences five times in one GPU run,
docs/training.md). This script takes the first ``--prompt`` tokens of each packed training sequence
and samples the rest from the target at ``--temperature`` (0: greedy), ``--seq-len`` tokens in all,
never drawing the ids in ``--ban`` (PARD's mask token must not occur in its training text). The
result is a ``.npy`` of shape (sequences, seq-len) that ``scripts/train_pard.py --tokens`` reads.

Resumable: each batch of ``--batch`` sequences is saved under ``<out>.partial/`` as it is done,
sampled from its own seed (``--seed`` and the batch's index), so a run stopped and started again
writes the same file as one that never stopped; ``--out`` is written once, whole, at the end.

Usage::

    python scripts/regenerate.py --out .cache/regen-512.npy --sequences 4096 --batch 1024 --device cuda
    python scripts/regenerate.py --out .cache/regen-512.npy --sequences 256 --batch 16 --threads 1   # a CPU
    python scripts/train_pard.py --out .cache/heads/pard-regen --tokens .cache/regen-512.npy
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

from sharpdraft_theory.atomic import atomic_path

from .common import atomic_text, check_device, log
from .pard import _check_source, packed  # the sources PARD's own training reads

OPTIONS = ("base", "prompts", "sources", "sequences", "seq_len", "prompt", "temperature", "ban", "batch", "seed")


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help=".npy file to write (refused if it exists)")
    ap.add_argument("--base", type=Path, default=None,
                    help="a transformers causal LM folder to sample from (default: SmolLM2-135M-Instruct, the target)")
    ap.add_argument("--prompts", type=Path, default=None,
                    help="a .npy of token sequences (N, >= --prompt) whose first --prompt tokens are the prompts, "
                         "instead of --sources")
    ap.add_argument("--sources", default="pydoc:train,stdlib",
                    help="training corpora, comma-separated: train splits, their recall: forms, or text files")
    ap.add_argument("--sequences", type=int, default=1024, help="sequences to write")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per sequence, prompt included")
    ap.add_argument("--prompt", type=int, default=64, help="tokens of real text that start each sequence")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; 0 for greedy")
    ap.add_argument("--ban", default="16", help="token ids never drawn, comma-separated (16: SmolLM2's PARD mask)")
    ap.add_argument("--batch", type=int, default=16, help="sequences sampled at once (and saved together)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    args = ap.parse_args(argv)
    check_options(args)
    return args


def check_options(args: argparse.Namespace) -> None:
    """Every bad value refused in one line, before any model loads."""
    for name, least in (("sequences", 1), ("seq_len", 2), ("prompt", 1), ("batch", 1), ("threads", 1)):
        if getattr(args, name) < least:
            raise SystemExit(f"--{name.replace('_', '-')} {getattr(args, name)}: give an integer >= {least}")
    if not 0 <= args.seed < 2 ** 32:
        raise SystemExit(f"--seed {args.seed}: give an integer from 0 to {2 ** 32 - 1}")
    args.batch = min(args.batch, args.sequences)  # a batch never holds more than the run
    if args.prompt >= args.seq_len:
        raise SystemExit(f"--prompt {args.prompt}: give fewer tokens than --seq-len {args.seq_len}, so that some are "
                         "sampled")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise SystemExit(f"--temperature {args.temperature}: give a finite temperature >= 0 (0: greedy)")
    try:
        args.ban_ids = sorted({int(t) for t in args.ban.split(",") if t.strip()}) if args.ban.strip() else []
    except ValueError:
        raise SystemExit(f"--ban {args.ban!r}: give token ids, comma-separated (or an empty string)") from None
    if any(t < 0 for t in args.ban_ids):
        raise SystemExit(f"--ban {args.ban}: token ids are >= 0")
    if args.out.exists():
        raise SystemExit(f"--out {args.out}: exists; give a new file (nothing is overwritten)")
    if args.out.suffix != ".npy":
        raise SystemExit(f"--out {args.out}: give a .npy file name")
    above = next((d for d in args.out.parents if d.exists()), None)
    if above is not None and not above.is_dir():
        raise SystemExit(f"--out {args.out}: {above} is a file; give a path in a folder")
    if args.base is not None and not (args.base / "config.json").is_file():
        raise SystemExit(f"--base {args.base}: no config.json there; give a transformers causal LM folder")
    if args.prompts is not None and not args.prompts.is_file():
        raise SystemExit(f"--prompts {args.prompts}: no such file; give a .npy of token sequences")
    if args.prompts is None and args.base is not None:
        raise SystemExit(f"--base {args.base}: give --prompts too (no tokenizer is read from a --base folder)")
    if args.base is None:
        from ..drafters.pard_smollm2 import SMOLLM2_VOCAB

        if any(t >= SMOLLM2_VOCAB for t in args.ban_ids):
            raise SystemExit(f"--ban {args.ban}: SmolLM2 has {SMOLLM2_VOCAB} tokens; give ids below it")
    if args.prompts is None:
        for source in args.sources.split(","):
            _check_source(source)


def load(args):
    """(model, prompts (N, --prompt) int64): the target, or --base, and the prompts (at most --sequences)."""
    if args.base is None:
        from ..smollm2 import load_smollm2

        model, tokenizer = load_smollm2()
    else:
        from transformers import AutoModelForCausalLM

        model, tokenizer = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32), None
    vocab = model.get_input_embeddings().weight.shape[0]
    if any(t >= vocab for t in args.ban_ids):
        raise SystemExit(f"--ban {args.ban}: the model has {vocab} tokens; give ids below it")
    if args.prompts is not None:
        try:
            ids = np.load(args.prompts)
        except (OSError, ValueError, EOFError) as err:
            raise SystemExit(f"--prompts {args.prompts}: not a .npy array ({err.__class__.__name__}); give one of "
                             "token sequences") from None
        if ids.ndim != 2 or ids.shape[1] < args.prompt or ids.shape[0] == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise SystemExit(f"--prompts {args.prompts}: shape {ids.shape}, {ids.dtype}; expected integers (N, >= "
                             f"--prompt {args.prompt})")
        prompts = torch.from_numpy(ids[:, :args.prompt].astype(np.int64))
    else:  # the start of each packed training sequence, so that the prompts spread over the whole split
        prompts = torch.tensor([s[:args.prompt] for s in packed(args.sources, tokenizer, args.seq_len, args.sequences)])
    if int(prompts.min()) < 0 or int(prompts.max()) >= vocab:
        raise SystemExit(f"prompt tokens outside the model's vocabulary of {vocab}")
    return model.eval(), prompts


@torch.no_grad()
def continue_text(model, prompts: torch.Tensor, new: int, temperature: float, ban: list[int],
                  generator: torch.Generator | None) -> torch.Tensor:
    """(B, P + new): ``prompts`` (B, P) each continued by ``new`` tokens drawn from the model's next-token law at
    ``temperature`` (0: its argmax) with the ``ban`` ids removed, one forward per token over the model's KV cache."""
    from ..speculative import cached_forward, new_cache

    cache = new_cache()  # filled in place by each forward
    logits = cached_forward(model, prompts, cache, logits_to_keep=1).logits[:, -1]  # not (B, P, vocab)
    tokens = [prompts]
    for i in range(new):
        logits = logits.float()
        if ban:
            logits[:, ban] = -math.inf
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            nxt = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator)
        tokens.append(nxt)
        if i + 1 < new:
            logits = cached_forward(model, nxt, cache).logits[:, -1]
    return torch.cat(tokens, dim=1)


def _save_npy(array: np.ndarray, path: Path) -> None:
    """Written whole or not at all (a temporary file beside it, then renamed)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, array)


def main(argv=None) -> None:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    device = check_device(args.device)
    work = args.out.with_name(args.out.name + ".partial")
    options = {k: str(getattr(args, k)) for k in OPTIONS}
    record = work / "run.json"
    if record.is_file():
        try:
            saved = json.loads(record.read_text())
        except ValueError:
            saved = None
        if saved != options:
            sys.exit(f"{work}: holds a run with other options; give the same options or delete it")
    model, prompts = load(args)
    model = model.to(device)
    work.mkdir(parents=True, exist_ok=True)  # and --out's folder
    atomic_text(record, json.dumps(options) + "\n")
    batches = -(-args.sequences // args.batch)
    new = args.seq_len - args.prompt
    for b in range(batches):
        path = work / f"batch-{b:05d}.npy"
        if path.is_file():
            continue
        generator = torch.Generator(device=device).manual_seed(args.seed * 1_000_003 + b)
        # more sequences than prompts: the prompts again, in order (each continuation is its own draw)
        first, last = b * args.batch, min((b + 1) * args.batch, args.sequences)
        rows = prompts[torch.arange(first, last) % len(prompts)].to(device)
        text = continue_text(model, rows, new, args.temperature, args.ban_ids, generator)
        _save_npy(text.cpu().numpy().astype(np.int32), path)
        log(f"batch {b + 1}/{batches}: {len(rows)} sequences of {args.seq_len} ({new} sampled each)")
    whole = np.concatenate([np.load(work / f"batch-{b:05d}.npy") for b in range(batches)])
    _save_npy(whole, args.out)
    for path in work.iterdir():
        path.unlink()
    work.rmdir()
    log(f"wrote {args.out}: {whole.shape[0]} sequences of {whole.shape[1]} tokens")


if __name__ == "__main__":
    main()
