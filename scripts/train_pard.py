"""Train a PARD drafter for SmolLM2-135M-Instruct (a ``--drafter pard`` folder).

PARD (AMD-AGI/PARD, arXiv:2504.18583) adapts a small causal LM that shares the target's vocabulary
into a parallel drafter: one forward over the last token and ``K - 1`` mask tokens drafts ``K``
tokens (``calibrate/drafters/parallel.py``). The recipe, as ``calibrate/drafters/pard_recipe.py``
lays it out:

1. The drafter: SmolLM2's embedding, its first ``--layers`` decoder layers, its final norm and its
   (tied) LM head, weights copied, so a forward costs a fraction of the target's (4 of 30 layers plus
   the LM head by default). Every weight trains except the embedding and the LM head it is tied to
   (frozen: the drafter keeps the target's token space).
2. Each training sequence of ``--seq-len`` tokens (``n_ref``, the config's ``max_seq_length``) is
   laid out with ``--copies - 1`` mask copies (mask token ``--mask-token``: SmolLM2's
   ``<empty_output>``, id 16, which the corpora never contain), each row seeing exactly what it would
   see at inference, and PARD's conditional drop keeping a fraction ``max(r^c, r_min)`` of copy ``c``
   (``--ratio``, ``--min-ratio``). Defaults are PARD's: 8 copies, 0.7, 0.2, length 512.
3. Loss: the mean cross-entropy of every row against the true next token (copy 0: the next token;
   copy ``c``: ``c + 1`` tokens past the last real one), AdamW at a constant ``--lr``.
4. Progress is saved every ``--save-every`` steps under ``--work`` (atomically; a stopped run
   resumes with the same options), and the drafter folder is written to ``--out`` (bf16, about 85 MB
   at 4 layers) with ``training_log.json`` (the command, n_ref and the loss history).

Usage (``--device cuda`` on a GPU machine)::

    python scripts/train_pard.py --out .cache/heads/pard-smollm2
    sharpdraft eval --drafter pard --drafter-path .cache/heads/pard-smollm2 --corpus stdlib:heldout \\
        --lengths 256 --sequences 12 --speculative --num-draft 4
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from target_features import check_device, log  # noqa: E402
from train_demo_eagle3 import atomic_save, atomic_text  # noqa: E402

from calibrate.drafters.pard_recipe import IGNORE, pard_rows, truncated_drafter  # noqa: E402

SAVED_OPTIONS = ("base", "layers", "copies", "ratio", "min_ratio", "seq_len", "sources", "tokens", "sequences",
                 "batch", "lr", "mask_token", "seed")  # a resumed run must have been started with these


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="drafter folder to write (replaced at every save)")
    ap.add_argument("--work", type=Path, default=None, help="progress folder (default .cache/train-<out name>)")
    ap.add_argument("--base", type=Path, default=None,
                    help="a transformers causal LM folder to cut the drafter from (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers the drafter keeps (from the first)")
    ap.add_argument("--copies", type=int, default=8, help="copies of each sequence: the real one and mask copies")
    ap.add_argument("--ratio", type=float, default=0.7, help="conditional drop: copy c keeps ratio^c of its rows")
    ap.add_argument("--min-ratio", type=float, default=0.2, help="conditional drop: the least fraction a copy keeps")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence (n_ref)")
    ap.add_argument("--sources", default="pydoc:train,stdlib", help="training corpora, comma-separated (train splits)")
    ap.add_argument("--tokens", type=Path, default=None,
                    help="a .npy file of token sequences (N, seq-len) to train on instead of --sources")
    ap.add_argument("--sequences", type=int, default=256, help="training sequences drawn from --sources")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--mask-token", type=int, default=16, help="the drafter's pard_token")
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    args = ap.parse_args(argv)
    check_options(args)
    return args


def check_options(args: argparse.Namespace) -> None:
    """Every option's bad values refused in one line, before any model loads."""
    for name, least in (("layers", 1), ("copies", 2), ("seq_len", 4), ("sequences", 1), ("batch", 1),
                        ("steps", 1), ("save_every", 1), ("threads", 1), ("mask_token", 0)):
        if getattr(args, name) < least:
            raise SystemExit(f"--{name.replace('_', '-')} {getattr(args, name)}: give an integer >= {least}")
    if args.copies >= args.seq_len - 1:
        raise SystemExit(f"--copies {args.copies}: give fewer than --seq-len - 1 ({args.seq_len - 1})")
    for name in ("ratio", "min_ratio"):
        value = getattr(args, name)
        if not (math.isfinite(value) and 0 < value <= 1):
            raise SystemExit(f"--{name.replace('_', '-')} {value}: give a fraction in (0, 1]")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise SystemExit(f"--lr {args.lr}: give a positive learning rate")
    if args.out.exists() and not args.out.is_dir():
        raise SystemExit(f"--out {args.out}: is a file; give a folder to write the drafter to")
    if args.base is not None and args.out.resolve() == args.base.resolve():
        raise SystemExit(f"--out {args.out}: is the --base folder; give another folder")
    if args.base is not None and not (args.base / "config.json").is_file():
        raise SystemExit(f"--base {args.base}: no config.json there; give a transformers causal LM folder")
    if args.tokens is not None and not args.tokens.is_file():
        raise SystemExit(f"--tokens {args.tokens}: no such file; give a .npy of token sequences")
    if args.work is None:
        args.work = Path(".cache") / f"train-{args.out.name}"
    if args.work.resolve() == args.out.resolve():
        raise SystemExit(f"--work {args.work}: is --out; give another folder")


def load_base(args):
    """(base model, tokenizer or None)."""
    if args.base is None:
        from calibrate.smollm2 import load_smollm2

        return load_smollm2()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32).eval(), None


def training_tokens(args, tokenizer, vocab: int) -> torch.Tensor:
    """(N, seq_len) token ids: the --tokens file, or --sequences packed from --sources."""
    if args.tokens is not None:
        ids = torch.from_numpy(np.load(args.tokens)).long()
        if ids.ndim != 2 or ids.shape[1] != args.seq_len or ids.shape[0] == 0:
            sys.exit(f"--tokens {args.tokens}: shape {tuple(ids.shape)}; expected (N, --seq-len {args.seq_len})")
    else:
        if tokenizer is None:
            sys.exit(f"--base {args.base}: with a base folder give --tokens (no tokenizer is read from it)")
        from calibrate.corpus import pack
        from calibrate.drafters.target import eos_token_id

        encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        sources = args.sources.split(",")
        per = -(-args.sequences // len(sources))
        seqs = [s for source in sources for s in pack(source, encode, eos_token_id(tokenizer), args.seq_len, per)]
        ids = torch.tensor(seqs[:args.sequences])
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        sys.exit(f"training tokens outside the vocabulary of {vocab}")
    if args.mask_token >= vocab or bool((ids == args.mask_token).any()):
        sys.exit(f"--mask-token {args.mask_token}: outside the vocabulary of {vocab} or present in the training "
                 "text; give an unused token id")
    return ids


def step_loss(model, ids: torch.Tensor, args, generator: torch.Generator, device) -> torch.Tensor:
    """The mean cross-entropy over the PARD rows of the sequences ``ids`` (B, L), one forward each."""
    total, count = 0.0, 0
    for seq in ids:
        rows = pard_rows(seq, args.copies, args.mask_token, args.ratio, args.min_ratio, generator)
        logits = model(input_ids=rows.input_ids[None].to(device), position_ids=rows.position_ids[None].to(device),
                       attention_mask=rows.mask().to(device)).logits[0]
        targets = rows.targets.to(device)
        total = total + torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=IGNORE,
                                                          reduction="sum")
        count += int((targets != IGNORE).sum())
    return total / count


def write_drafter(model, args, history: list, step: int) -> None:
    """The drafter folder (bf16) and its training log, swapped in whole: never half a folder."""
    tmp = args.out.with_name(args.out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tied = model.config.get_text_config().tie_word_embeddings  # the LM head is the embedding: stored once
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    model.save_pretrained(tmp, state_dict=state)
    log_record = {"n_ref": args.seq_len, "step": step, "command": " ".join(sys.argv),
                  "recipe": {k: str(getattr(args, k)) for k in SAVED_OPTIONS}, "loss": history}
    atomic_text(tmp / "training_log.json", json.dumps(log_record, indent=1) + "\n")
    old = args.out.with_name(args.out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if args.out.exists():
        os.replace(args.out, old)
    os.replace(tmp, args.out)
    shutil.rmtree(old, ignore_errors=True)


def main(argv=None) -> None:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    device = check_device(args.device)
    args.work.mkdir(parents=True, exist_ok=True)
    state_path = args.work / "state.pt"
    saved = torch.load(state_path, weights_only=False) if state_path.exists() else None
    options = {k: str(getattr(args, k)) for k in SAVED_OPTIONS}
    if saved is not None and saved["options"] != options:
        changed = [k for k in SAVED_OPTIONS if saved["options"].get(k) != options[k]]
        sys.exit(f"--work {args.work}: holds a run started with other options ({', '.join(changed)}); "
                 "give the same options or another --work")

    base, tokenizer = load_base(args)
    if args.layers > base.config.num_hidden_layers:
        sys.exit(f"--layers {args.layers}: the base model has {base.config.num_hidden_layers}")
    vocab = base.get_input_embeddings().weight.shape[0]
    ids = training_tokens(args, tokenizer, vocab)
    model = truncated_drafter(base, args.layers, args.mask_token, args.seq_len).to(device)
    del base
    for frozen in (model.get_input_embeddings(), model.get_output_embeddings()):  # the target's token space
        frozen.weight.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=args.lr, weight_decay=0.0)
    step, history = 0, []
    if saved is not None:
        model.load_state_dict(saved["model"], strict=False)
        optimizer.load_state_dict(saved["optimizer"])
        step, history = saved["step"], saved["history"]
        log(f"resumed at step {step}")
    model.train()
    log(f"{len(ids)} sequences of {args.seq_len}; {sum(p.numel() for p in trained):,} trained weights; "
        f"{args.copies} copies, drop {args.ratio}/{args.min_ratio}")
    started = time.time()
    while step < args.steps:
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step)  # the same draw when resumed
        batch = ids[torch.randint(len(ids), (args.batch,), generator=generator)]
        loss = step_loss(model, batch, args, generator, device)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        history.append([step, round(loss.item(), 4)])
        if step % args.save_every == 0 or step == args.steps:
            trainable = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
            atomic_save({"options": options, "model": trainable, "optimizer": optimizer.state_dict(),
                         "step": step, "history": history}, state_path)
            model.eval()
            write_drafter(model, args, history, step)
            model.train()
            log(f"step {step}/{args.steps}: loss {loss.item():.4f} ({(time.time() - started) / 60:.1f} min)")


if __name__ == "__main__":
    main()
