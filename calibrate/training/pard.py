"""Train a PARD drafter for SmolLM2-135M-Instruct (a folder for ``calibrate.drafters.pard_smollm2``).

PARD (AMD-AGI/PARD, arXiv:2504.18583) adapts a small causal LM that shares the target's vocabulary
into a parallel drafter: one forward over the last token and ``K - 1`` mask tokens drafts ``K``
tokens (``calibrate/drafters/parallel.py``). The recipe, as ``pard/pard_train.py`` trains it and
``calibrate/drafters/pard_recipe.py`` lays it out:

1. The drafter: SmolLM2's embedding, ``--layers`` of its decoder layers (the first ``--layers -
   --last``, then its last ``--last``: by default layers 0, 1, 2 and 29), its final norm and its tied
   LM head, weights copied, so a forward costs about a third of the target's. The layers and the norm
   train in full; the embedding and the LM head tied to it stay frozen (the drafter keeps the
   target's token space) and are not saved.
2. Each training sequence of ``--seq-len`` tokens (``n_ref``, the config's ``max_seq_length``) is
   followed by ``--k - 1`` copies made of the mask token (``--mask-token``: SmolLM2's
   ``<empty_output>``, id 16, which the corpora never contain), every copy at positions ``0 ..
   L - 1``, all in one forward with a 4-D attention mask and explicit ``position_ids``. The row of copy
   ``c`` at position ``t`` stands for mask ``c`` after the anchor ``a = t - c``: it sees the real
   tokens ``x_0 .. x_a`` and the masks of its anchor up to itself, what that mask sees at inference,
   and is trained on ``x_{t + 1}``. Copy 0 is the plain next-token layout.
3. Conditional drop (PARD's COD): copy ``c`` keeps ``max(r^c, r_min)`` of its anchors (``--ratio``,
   ``--min-ratio``), drawn among those copy ``c - 1`` kept, so a kept row still has the masks it
   needs; a step's draw depends only on ``--seed`` and the step number. Defaults are PARD's: 8 copies
   (``K`` up to 8 at inference, 4 in this toolkit's runs), 0.7, 0.2, length 512.
4. Loss: the mean cross-entropy of every kept row against its token, AdamW at a constant ``--lr``,
   gradients clipped to norm 1 (the Trainer's defaults PARD runs under).
5. Progress is saved every ``--save-every`` steps under ``--work`` (atomically; a stopped run resumes
   with the same options), and the drafter folder is written to ``--out``, replaced whole: ``config.json``,
   ``model.safetensors`` with the trained tensors only (float32, 57 MB at 4 layers) and
   ``training_log.json`` (the command, n_ref and the loss history). ``calibrate.drafters.pard_smollm2.
   build_pard_drafter`` puts it back together with SmolLM2's embedding.

Training text: ``--sources`` (train splits only: ``pydoc``, ``stdlib``, their ``recall:`` forms, or
text files), packed as ``calibrate.corpus.pack`` packs evaluation text, or a ``--tokens`` .npy file.

Usage (``--device cuda`` on a GPU machine)::

    OMP_NUM_THREADS=1 python scripts/train_pard.py --out .cache/heads/pard-smollm2 --threads 1
    python scripts/train_pard.py --out .cache/heads/pard-smollm2 --device cuda --batch 16
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ..drafters.pard_recipe import IGNORE, PardRows, pard_rows
from ..drafters.pard_smollm2 import SMOLLM2, SMOLLM2_LAYERS, SMOLLM2_VOCAB, cut_drafter, layers_from, trained_state
from .common import atomic_folder, atomic_save, atomic_text, atomic_weights, check_device, descend, log
from .loss import distillation_loss

SAVED_OPTIONS = ("base", "layers", "last", "k", "ratio", "min_ratio", "seq_len", "sources", "tokens", "sequences",
                 "batch", "lr", "mask_token", "seed", "distill", "distill_top")  # a resumed run was started with these
LEGACY_OPTIONS = {"copies": "k"}  # progress saved before --k was named so
LEGACY_DEFAULTS = {"last": "0", "distill": "0.0", "distill_top": "32"}  # ... and before --last, --distill existed
CORPUS_SPLITS = ("pydoc", "stdlib")


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="drafter folder to write (replaced at every save)")
    ap.add_argument("--work", type=Path, default=None, help="progress folder (default .cache/train-<out name>)")
    ap.add_argument("--base", type=Path, default=None,
                    help="a transformers causal LM folder to cut the drafter from (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers the drafter has")
    ap.add_argument("--last", type=int, default=1,
                    help="of them, how many are the base's last layers (the others are its first)")
    ap.add_argument("--k", type=int, default=8, help="copies of each sequence: the real one and k - 1 of mask tokens")
    ap.add_argument("--ratio", type=float, default=0.7, help="conditional drop: copy c keeps ratio^c of its rows")
    ap.add_argument("--min-ratio", type=float, default=0.2, help="conditional drop: the least fraction a copy keeps")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence (n_ref)")
    ap.add_argument("--sources", default="pydoc:train,stdlib", help="training corpora, comma-separated (train splits)")
    ap.add_argument("--tokens", type=Path, default=None,
                    help="a .npy file of token sequences (N, seq-len) to train on instead of --sources")
    ap.add_argument("--sequences", type=int, default=256, help="training sequences drawn from --sources")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--mask-token", type=int, default=16, help="the drafter's pard_token")
    ap.add_argument("--distill", type=float, default=0.0,
                    help="weight of the target's next-token law in the loss (0: PARD's cross-entropy on the text "
                         "alone; w: (1 - w) text + w target)")
    ap.add_argument("--distill-top", type=int, default=32,
                    help="the target's law kept on its top tokens at each position, renormalised")
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    args = ap.parse_args(argv)
    check_options(args)
    return args


def _base_shape(args) -> tuple[int, int]:
    """(decoder layers, vocabulary) of the base model, read without loading it."""
    if args.base is None:
        return SMOLLM2_LAYERS, SMOLLM2_VOCAB
    try:
        config = json.loads((args.base / "config.json").read_text())
        config = config.get("text_config", config)
        return int(config["num_hidden_layers"]), int(config["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise SystemExit(f"--base {args.base}: cannot read its config.json ({err.__class__.__name__}); give a "
                         "transformers causal LM folder") from None


def _check_source(source: str) -> None:
    """A training source: pydoc or stdlib's train split (or recall: of it), or a file or folder of text."""
    inner = source.removeprefix("recall:")
    name, _, split = inner.partition(":")
    if not inner:
        raise SystemExit(f"--sources {source!r}: an empty source; give e.g. pydoc:train,stdlib")
    if name in CORPUS_SPLITS:
        if split not in ("", "train"):
            raise SystemExit(f"--sources {source}: train only on the train split ({name}:train); {split!r} "
                             "holds held-out text or is no split")
    elif not Path(inner).exists():
        raise SystemExit(f"--sources {source}: no such file or folder; give pydoc:train, stdlib, their recall: "
                         "forms, or text files")


def check_options(args: argparse.Namespace) -> None:
    """Every option's bad values refused in one line, before any model loads."""
    for name, least in (("layers", 1), ("last", 0), ("k", 2), ("seq_len", 4), ("sequences", 1), ("batch", 1),
                        ("steps", 1), ("save_every", 1), ("threads", 1), ("mask_token", 0)):
        if getattr(args, name) < least:
            raise SystemExit(f"--{name.replace('_', '-')} {getattr(args, name)}: give an integer >= {least}")
    if args.out.exists() and not args.out.is_dir():
        raise SystemExit(f"--out {args.out}: is a file; give a folder to write the drafter to")
    if args.base is not None:
        if args.out.resolve() == args.base.resolve():
            raise SystemExit(f"--out {args.out}: is the --base folder; give another folder")
        if not (args.base / "config.json").is_file():
            raise SystemExit(f"--base {args.base}: no config.json there; give a transformers causal LM folder")
    base_layers, vocab = _base_shape(args)
    where = "SmolLM2 has" if args.base is None else "the --base model has"
    if args.layers > base_layers:
        raise SystemExit(f"--layers {args.layers}: {where} {base_layers} decoder layers; give 1 to {base_layers}")
    if args.last > args.layers:
        raise SystemExit(f"--last {args.last}: more than --layers {args.layers}")
    if args.k >= args.seq_len - 1:
        raise SystemExit(f"--k {args.k}: give fewer than --seq-len - 1 ({args.seq_len - 1})")
    if args.mask_token >= vocab:
        raise SystemExit(f"--mask-token {args.mask_token}: {where} {vocab} tokens; give an unused token id below it")
    for name in ("ratio", "min_ratio"):
        value = getattr(args, name)
        if not (math.isfinite(value) and 0 < value <= 1):
            raise SystemExit(f"--{name.replace('_', '-')} {value}: give a fraction in (0, 1]")
    if not (math.isfinite(args.distill) and 0 <= args.distill <= 1):
        raise SystemExit(f"--distill {args.distill}: give a weight in [0, 1] (0: the text alone)")
    if not 1 <= args.distill_top <= vocab:
        raise SystemExit(f"--distill-top {args.distill_top}: {where} {vocab} tokens; give 1 to {vocab}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise SystemExit(f"--lr {args.lr}: give a positive learning rate")
    if args.tokens is not None:
        if not args.tokens.is_file():
            raise SystemExit(f"--tokens {args.tokens}: no such file; give a .npy of token sequences")
    else:
        for source in args.sources.split(","):
            _check_source(source)
    if args.work is None:
        args.work = Path(".cache") / f"train-{args.out.name}"
    if args.work.exists() and not args.work.is_dir():
        raise SystemExit(f"--work {args.work}: is a file; give a folder for the progress")
    if args.work.resolve() == args.out.resolve():
        raise SystemExit(f"--work {args.work}: is --out; give another folder")


def load_base(args):
    """(base model, tokenizer or None, the config's embedding marker)."""
    if args.base is None:
        from ..smollm2 import load_smollm2

        model, tokenizer = load_smollm2()
        return model, tokenizer, SMOLLM2
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32).eval()
    return model, None, str(args.base.resolve())


def packed(sources: str, tokenizer, seq_len: int, sequences: int) -> list[list[int]]:
    """At most ``sequences`` token sequences of ``seq_len`` from ``sources`` (comma-separated), as many from each;
    a source too short is named in one line (``--sources``, ``--seq-len``)."""
    from ..corpus import pack
    from ..drafters.target import eos_token_id
    from ..errors import UserError

    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    names = sources.split(",")
    per = -(-sequences // len(names))
    try:
        seqs = [s for source in names for s in pack(source, encode, eos_token_id(tokenizer), seq_len, per)]
    except UserError as err:
        sys.exit(str(err).replace("--corpus", "--sources").replace("--max-length", "--seq-len"))
    return seqs[:sequences]


def training_tokens(args, tokenizer, vocab: int) -> torch.Tensor:
    """(N, seq_len) token ids: the --tokens file, or --sequences packed from --sources."""
    if args.tokens is not None:
        ids = torch.from_numpy(np.load(args.tokens)).long()
        if ids.ndim != 2 or ids.shape[1] != args.seq_len or ids.shape[0] == 0:
            sys.exit(f"--tokens {args.tokens}: shape {tuple(ids.shape)}; expected (N, --seq-len {args.seq_len})")
    else:
        if tokenizer is None:
            sys.exit(f"--base {args.base}: with a base folder give --tokens (no tokenizer is read from it)")
        ids = torch.tensor(packed(args.sources, tokenizer, args.seq_len, args.sequences))
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        sys.exit(f"training tokens outside the vocabulary of {vocab}")
    if bool((ids == args.mask_token).any()):
        sys.exit(f"--mask-token {args.mask_token}: present in the training text; give an unused token id")
    return ids


def step_rows(ids: torch.Tensor, args, step: int) -> list:
    """The PARD rows (``pard_recipe.PardRows``) of the sequences ``ids`` (B, L) at ``step``: their conditional
    drop drawn from ``--seed`` and the step alone, so a resumed run draws what an unbroken one does."""
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    return [pard_rows(seq, args.k, args.mask_token, args.ratio, args.min_ratio, generator) for seq in ids]


@torch.no_grad()
def teacher_laws(target, ids: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's next-token law at every position of ``ids`` (B, L), kept on its ``top`` likeliest tokens and
    renormalised: probabilities and token ids, (B, L, top) each. Position ``t``'s law is that of ``x_{t+1}`` given
    ``x_0 .. x_t``: what every PARD row at position ``t`` guesses, whatever its copy."""
    probs, tokens = [], []
    for seq in ids:  # one sequence at a time: (L, vocab) logits, not (B, L, vocab)
        logits = target(input_ids=seq[None]).logits[0].float()
        values, index = logits.topk(top, dim=-1)
        probs.append(torch.softmax(values, dim=-1))
        tokens.append(index)
    return torch.stack(probs), torch.stack(tokens)


def row_loss(logits: torch.Tensor, rows, distill: float = 0.0, laws=None) -> torch.Tensor:
    """Summed loss of one sequence's kept rows: cross-entropy on the text, or with ``distill`` = w > 0,
    ``(1 - w)`` of it plus ``w`` times the cross-entropy against the target's law at each row's position
    (``laws``: one sequence's (L, top) probabilities and token ids from :func:`teacher_laws`). That second term is
    the KL divergence from the target's law plus its entropy, which the drafter cannot change."""
    text = torch.nn.functional.cross_entropy(logits, rows.targets, ignore_index=IGNORE, reduction="sum")
    if distill == 0:
        return text
    kept = rows.targets != IGNORE
    probs, tokens = laws
    where = rows.position_ids[kept]
    return (1 - distill) * text + distill * distillation_loss(logits[kept], probs[where], tokens[where], "sum")


def step_loss(model, rows: list, device, backward: bool = True, distill: float = 0.0, laws=None) -> float:
    """The mean loss (:func:`row_loss`) over every kept row of ``rows`` (one forward per sequence; with ``backward``,
    each sequence's share of the gradient is accumulated as it goes, so one graph is held at a time)."""
    count = sum(int((r.targets != IGNORE).sum()) for r in rows)
    total = 0.0
    for b, r in enumerate(rows):
        r = PardRows(*(t.to(device) for t in (r.input_ids, r.position_ids, r.copy, r.targets)))
        logits = model(input_ids=r.input_ids[None], position_ids=r.position_ids[None],
                       attention_mask=r.mask()).logits[0]
        law = None if laws is None else (laws[0][b], laws[1][b])
        loss = row_loss(logits.float(), r, distill, law) / count
        if backward:
            loss.backward()
        total += loss.item()
    return total


def write_drafter(model, args, history: list, step: int, seconds: float) -> None:
    """The drafter folder, swapped in whole (never half a folder): config.json, the trained tensors, the log."""
    with atomic_folder(args.out) as tmp:
        config = model.config.to_dict()
        config.pop("transformers_version", None)
        atomic_text(tmp / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
        atomic_weights(trained_state(model), tmp / "model.safetensors")
        argv = sys.argv[1:] if args.argv is None else args.argv
        record = {"command": "python scripts/train_pard.py " + " ".join(argv), "n_ref": args.seq_len, "k": args.k,
                  "layers_from": model.config.sharpdraft_layers_from,
                  "embedding_from": model.config.sharpdraft_embedding_from, "steps_done": step,
                  "train_seconds": round(seconds, 1), "threads": args.threads, "device": args.device,
                  "torch": torch.__version__, "recipe": {k: str(getattr(args, k)) for k in SAVED_OPTIONS},
                  "loss": history}
        atomic_text(tmp / "training_log.json", json.dumps(record, indent=1) + "\n")


def _saved_options(saved: dict) -> dict:
    """A progress file's options under today's names (older runs: ``copies`` for ``k``, no ``last``)."""
    options = {LEGACY_OPTIONS.get(k, k): v for k, v in saved["options"].items()}
    return {**LEGACY_DEFAULTS, **options}


def main(argv=None) -> None:
    args = parse(argv)
    args.argv = argv
    torch.set_num_threads(args.threads)
    device = check_device(args.device)
    args.work.mkdir(parents=True, exist_ok=True)
    state_path = args.work / "state.pt"
    saved = torch.load(state_path, weights_only=False, map_location="cpu") if state_path.exists() else None
    options = {k: str(getattr(args, k)) for k in SAVED_OPTIONS}
    if saved is not None and _saved_options(saved) != options:
        changed = [k for k in SAVED_OPTIONS if _saved_options(saved).get(k) != options[k]]
        sys.exit(f"--work {args.work}: holds a run started with other options ({', '.join(changed)}); "
                 "give the same options or another --work")

    base, tokenizer, embedding_from = load_base(args)
    vocab = base.get_input_embeddings().weight.shape[0]
    ids = training_tokens(args, tokenizer, vocab)
    source_layers = layers_from(args.layers, args.last, base.config.get_text_config().num_hidden_layers)
    model = cut_drafter(base, source_layers, args.mask_token, args.seq_len, embedding_from).to(device)
    teacher = base.to(device).eval() if args.distill > 0 else None  # the target whose law is distilled
    del base
    for frozen in (model.get_input_embeddings(), model.get_output_embeddings()):  # the target's token space
        frozen.weight.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=args.lr, weight_decay=0.0)
    step, history, seconds = 0, [], 0.0
    if saved is not None:
        model.load_state_dict(saved["model"], strict=False)
        optimizer.load_state_dict(saved["optimizer"])
        step, history, seconds = saved["step"], saved["history"], saved.get("seconds", 0.0)
        log(f"resumed at step {step}")
    model.train()
    log(f"{len(ids)} sequences of {args.seq_len}; {sum(p.numel() for p in trained):,} trained weights in layers "
        f"{source_layers} of the base; k {args.k}, drop {args.ratio}/{args.min_ratio}"
        + (f"; the target's law (top {args.distill_top}) at weight {args.distill}" if teacher is not None else ""))
    started = time.time() - seconds
    while step < args.steps:
        pick = torch.Generator().manual_seed(args.seed * 1_000_003 + step + 500_009)
        batch = ids[torch.randint(len(ids), (args.batch,), generator=pick)]
        optimizer.zero_grad(set_to_none=True)
        laws = None if teacher is None else teacher_laws(teacher, batch.to(device), args.distill_top)
        loss = step_loss(model, step_rows(batch, args, step), device, distill=args.distill, laws=laws)
        descend(trained, optimizer)
        step += 1
        history.append([step, round(loss, 4)])
        log(f"step {step}/{args.steps}: loss {loss:.4f} ({time.time() - started:.0f} s)")
        if step % args.save_every == 0 or step == args.steps:
            seconds = time.time() - started
            trainable = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
            atomic_save({"options": options, "model": trainable, "optimizer": optimizer.state_dict(),
                         "step": step, "history": history, "seconds": seconds}, state_path)
            model.eval()
            write_drafter(model, args, history, step, seconds)
            model.train()
    log(f"saved {args.out}")


if __name__ == "__main__":
    main()
