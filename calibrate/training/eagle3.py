"""Train the demo EAGLE-3 heads for SmolLM2-135M-Instruct (``calibrate/assets/eagle3-smollm2*``).

The heads are real EAGLE-3 drafters (Li et al., 2025, arXiv:2503.01840; one decoder layer over the
target's low / middle / high hidden states, official checkpoint layout), trained on a CPU:

* the **demo head** (``--span 256``, ``calibrate/assets/eagle3-smollm2``): no query sees more than
  ``n_ref = 256`` keys in training, each within a window of 253 consecutive rows. RoPE logits depend
  on the query-key distance only, so this head has never seen a distance above 256: at long context
  it meets more keys (dilution) *and* distances it was never trained on (drift);
* the **every-distance head** (``--span 256 --far 128``, ``calibrate/assets/eagle3-smollm2-far``):
  no query sees more than 256 keys either, but 128 of them are drawn at random from the whole
  earlier sequence (up to 8,191 back), so every distance is seen and at long context it differs
  from training only in how many keys a query sees: the regime the query scale corrects;
* the **long-trained reference** (``--span 8192``, ``calibrate/assets/eagle3-smollm2-long``): the
  same recipe, data and steps, with spans up to 8,192 keys: the upper bound a training-free length
  correction can hope to reach.

Recipe, seeded and deterministic given the same torch build and thread count:

1. Target features: ``scripts/target_features.py`` (SmolLM2's ``hidden_states[2, 15, 27]`` and final
   normed state over 64 packed sequences of 8,192 tokens: pydoc train split, then stdlib train
   split; 524,288 target tokens), read from its shard folder.
2. Draft vocabulary: the ``--draft-vocab`` most frequent target tokens of the training tokens,
   sorted by id (``d2t[i] = id - i``, ``t2d[id] = True``, as EAGLE-3 builds it).
3. Training-time test (EAGLE-3's): each window of head rows is unrolled ``--ttt`` drafting steps.
   Step 0 reads the target's features; step ``s`` reads the head's own output of step ``s - 1`` in
   place of the unknown target feature, the next token, and RoPE position ``+ s``, exactly as
   ``Eagle3Proposer.propose`` runs at inference. Its query at base row ``r`` attends to the
   step-0 keys of rows ``<= r`` (the true context) plus the keys of steps ``1 .. s`` at row ``r``
   (its own earlier drafts), which is the chain drafter's cache at that point. The head computes
   this itself (``Eagle3Head.unrolled``). Loss: the distillation loss (``.loss``), cross-entropy
   to the target's next-token distribution restricted to the draft vocabulary and renormalised
   (teacher logits = final hidden state @ the target's ``lm_head`` rows of the draft vocabulary),
   step ``s`` weighted ``0.8 ** s``.
4. Every optimiser step trains ``--rows`` (2,048) base rows. The demo head takes 8 windows of
   ``span - ttt + 1 = 253`` rows, so that no query, the last drafting step's included, sees more
   than 256 keys. The reference takes one window of 2,048 rows at a random offset, and its queries
   also see the step-0 keys of every earlier row of the sequence (computed in the same pass, with
   gradients), up to 8,191 keys. With ``--far F`` a window has ``span - ttt + 1 - F`` rows (125 for
   the every-distance head, 16 windows a step) and its queries also see the step-0 keys of ``F``
   positions drawn uniformly, without replacement, from the earlier sequence up to ``--reach`` before
   its last row. Sequences and offsets are random, positions true.
5. Progress is saved every ``--save-every`` steps under ``--work`` (atomically); a stopped run
   resumes from there. At the end: ``config.json`` (``max_position_embeddings = --span``: the
   training length, read as n_ref), ``model.safetensors`` in fp16 without ``embed_tokens`` (the
   target's is shared), and ``training_log.json``.

6. ``--init HEAD`` continues a head this script wrote: its weights, a fresh optimiser and schedule
   of ``--steps`` more steps (use another ``--seed`` so it draws other windows); the new record
   keeps the old one under ``init``. The packaged heads are two stages: 360 steps with the
   defaults, then 720 more at lr 1e-3 (their ``TRAINING.md`` files give the commands).

Usage (features first, then each head, in two stages)::

    python scripts/target_features.py
    python scripts/train_demo_eagle3.py --span 256 --out .cache/heads/eagle3-smollm2-v2
    python scripts/train_demo_eagle3.py --span 256 --steps 720 --lr 1e-3 --seed 1 \
        --init .cache/heads/eagle3-smollm2-v2 --out calibrate/assets/eagle3-smollm2
    (the same with --span 8192 and -long for the reference)

(the two heads can train at once, one thread each).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from ..drafters.eagle3 import Eagle3Config, Eagle3Head
from ..drafters.vocab import draft_vocabulary
from ..smollm2 import load_smollm2
from .common import (ROOT, RunningMean, atomic_text, atomic_weights, check_device, descend, log, optimiser, resume,
                     save_progress)
from .features import DEFAULT_OUT as FEATURES, load_shards
from .loss import distillation_loss

STEP_DECAY = 0.8  # loss weight of drafting step s: STEP_DECAY ** s (EAGLE-3's training-time test)


def sample_windows(gen: torch.Generator, data: dict, windows: int, rows: int, ttt: int, context: int,
                   far: int = 0, reach: int | None = None, weights: torch.Tensor | None = None, match: int = 0,
                   copied: bool = False):
    """``windows`` random windows of ``rows`` base rows with their true positions.

    Base row ``r`` at position ``p``: step 0 pairs feature ``p`` with token ``p + 1``; step ``s``
    reads token ``p + 1 + s`` at position ``p + s`` and guesses token ``p + 2 + s``, whose target
    distribution is the final state at ``p + 1 + s``. In front of the window's rows come ``C``
    key-only rows, whose step-0 keys every query of the window also sees:

    * ``context`` (one window only): the up to ``context`` rows just before the window;
    * ``far`` (any number of windows): ``far`` positions drawn uniformly without replacement from
      every earlier position of the sequence at most ``reach`` before the window's last row, sorted
      (windows start at position ``far`` or later, so each has ``far`` to draw from). With
      ``match`` > 0, up to ``match`` of them are **match keys** (:func:`match_positions`): earlier
      positions whose bigram is one the window's rows read, the keys a copy needs (drawn at random
      among them when there are more), the rest drawn uniformly from the other positions.

    Sequences are drawn uniformly, or with probabilities ``weights`` (S,) when given.

    Returns features (W, C + rows, 3H), tokens (W, C + rows + ttt - 1), teacher states
    (W, rows + ttt - 1 after C leading rows, as tokens), positions (W, C + rows), and C; with
    ``copied``, a sixth: (W, rows, ttt) bool, whether the token row ``r`` guesses at step ``s``
    (``p + 2 + s``) is copied (``data["copied"]``, a recall sequence's mask).
    """
    S, T = data["tokens"].shape
    if weights is None:
        seq = torch.randint(0, S, (windows,), generator=gen)
    else:
        seq = torch.multinomial(weights, windows, replacement=True, generator=gen)
    start = torch.randint(far, T - rows - ttt + 1, (windows,), generator=gen)
    window = start[:, None] + torch.arange(rows)  # (W, rows)
    if far:
        reach = T - 1 if reach is None else reach
        lowest = (start + rows - 1 - reach).clamp(min=0)  # (W,) the farthest key a window's last row may see
        front = torch.stack([_draw_far(gen, data["tokens"][q], int(a), int(lo), rows + ttt - 1, far, match)
                             for q, a, lo in zip(seq, start, lowest)])  # (W, far)
    else:
        c = min(int(start[0]), context) if context else 0
        front = start[:, None] - c + torch.arange(c)  # (W, c): the rows just before the window
    pos = torch.cat((front, window), dim=1)  # (W, C + rows)
    ahead = torch.cat((front + 1, start[:, None] + 1 + torch.arange(rows + ttt - 1)), dim=1)  # the token after each
    s = seq[:, None]
    out = (data["features"][s, pos].float(), data["tokens"][s, ahead], data["final"][s, ahead].float(), pos,
           front.shape[1])
    if not copied:
        return out
    guessed = (window[:, :, None] + 2 + torch.arange(ttt)).clamp(max=T - 1)  # (W, rows, ttt): token p + 2 + s
    return (*out, data["copied"][s[:, :, None], guessed])


def match_positions(tokens: torch.Tensor, start: int, lowest: int, rows: int) -> torch.Tensor:
    """Positions ``j`` in ``[lowest, start)`` whose bigram ``(tokens[j - 1], tokens[j])`` equals a bigram
    ``(tokens[p], tokens[p + 1])`` read by a row ``p`` in ``[start, start + rows)``.

    Row ``p`` holds feature ``p`` and token ``p + 1`` and guesses token ``p + 2``; the key row ``j``
    holds feature ``j`` and token ``j + 1``. Where the text repeats, the key whose own two tokens are
    the row's two tokens carries, as its token, the one to copy (an induction match, the n-gram a
    prompt lookup matches).

    >>> match_positions(torch.tensor([5, 1, 2, 3, 9, 1, 2]), start=5, lowest=0, rows=1).tolist()
    [2]
    """
    width = int(tokens.max()) + 1
    bigram = tokens[:-1] * width + tokens[1:]  # (T - 1,): bigram[i] = (tokens[i], tokens[i + 1])
    wanted = bigram[start:start + rows]
    j = torch.arange(max(lowest, 1), start)
    return j[torch.isin(bigram[j - 1], wanted)]


def _draw_far(gen: torch.Generator, tokens: torch.Tensor, start: int, lowest: int, rows: int, far: int,
              match: int) -> torch.Tensor:
    """``far`` distinct positions in ``[lowest, start)``, sorted: up to ``match`` match keys, the rest uniform."""
    picked = torch.empty(0, dtype=torch.long)
    if match:
        found = match_positions(tokens, start, lowest, rows)
        picked = found[torch.randperm(len(found), generator=gen)[:match]]
    others = torch.arange(lowest, start)
    others = others[~torch.isin(others, picked)]
    rest = others[torch.randperm(len(others), generator=gen)[:far - len(picked)]]
    return torch.cat((picked, rest)).sort().values


def copy_weights(data: dict, share: float, reach: int) -> torch.Tensor | None:
    """Sequence probabilities that put ``share`` of the windows on the sequences with copies a head can
    reach, in proportion to their copied tokens whose source lies at most ``reach`` back (the rest
    uniform). None (uniform) when ``share`` is 0 or no sequence has such copies.

    A recall sequence's distance (``calibrate.recall``) is read back from its tokens: the one of
    ``DISTANCES`` at which every copied token repeats its source.
    """
    from ..recall import DISTANCES

    S, T = data["tokens"].shape
    usable = torch.zeros(S, dtype=torch.float64)
    for i in range(S):
        t = torch.nonzero(data["copied"][i]).flatten()
        if not len(t):
            continue
        d = next((d for d in DISTANCES
                  if d <= int(t[0]) and torch.equal(data["tokens"][i, t], data["tokens"][i, t - d])), None)
        if d is None:
            raise SystemExit(f"features sequence {i}: its copied tokens repeat no distance of calibrate.recall")
        usable[i] = len(t) / T if d <= reach else 0.0
    if share == 0 or usable.sum() == 0:
        return None
    return (1 - share) / S + share * usable / usable.sum()


def unrolled_loss(head: Eagle3Head, teacher_w: torch.Tensor, batch, ttt: int, chunk: int,
                  row_weights: torch.Tensor | None = None):
    """Weighted soft cross-entropy over ``ttt`` drafting steps, and top-1 agreement per step.

    ``row_weights`` (W, T, ttt): each row's weight at each step (None: 1), the loss a weighted mean."""
    features, tokens, final, pos, context = batch
    T = pos.shape[1] - context
    loss = torch.zeros(())
    agreement = []
    for s, logits in enumerate(head.unrolled(features, tokens, pos, ttt, chunk, context)):
        with torch.no_grad():
            target_p = torch.softmax((final[:, context + s:context + s + T] @ teacher_w.T).float(), dim=-1)
        ce = distillation_loss(logits.float(), target_p)  # (W, T)
        w = None if row_weights is None else row_weights[:, :, s].to(ce.dtype)
        step_loss = ce.mean() if w is None else (ce * w).sum() / w.sum()
        loss = loss + STEP_DECAY ** s * step_loss
        agreement.append((logits.argmax(-1) == target_p.argmax(-1)).float().mean().item())
    return loss / sum(STEP_DECAY ** s for s in range(ttt)), agreement


def _steps_of(record: dict) -> int:
    """Optimiser steps behind a training record (records before ``steps_total``: from its command; a head
    grown by scripts/induction_head.py: its source head's, kept under ``head``; 0 when none is recorded)."""
    if "steps_total" in record:
        return int(record["steps_total"])
    if isinstance(record.get("head"), dict):
        return _steps_of(record["head"])
    command = str(record.get("command", ""))
    return int(command.split("--steps ")[1].split()[0]) if "--steps " in command else 0


def _seconds_of(record: dict) -> float:
    """Training seconds behind a record, as :func:`_steps_of` counts its steps."""
    if "train_seconds_total" in record or "train_seconds" in record:
        return float(record.get("train_seconds_total", record.get("train_seconds")))
    return _seconds_of(record["head"]) if isinstance(record.get("head"), dict) else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="checkpoint folder to write")
    ap.add_argument("--features", type=Path, default=FEATURES, help="shard folder of scripts/target_features.py")
    ap.add_argument("--work", type=Path, default=None, help="progress folder (default .cache/train-<out name>)")
    ap.add_argument("--span", type=int, default=256,
                    help="keys a query sees at most in training (n_ref): windows of span - ttt + 1 base rows, "
                         "whose last drafting step sees span keys")
    ap.add_argument("--far", type=int, default=0,
                    help="keys drawn per window from the whole earlier sequence (at most --reach back), seen by "
                         "every query of the window besides the window's own rows: windows of span - ttt + 1 - far "
                         "base rows, so no query sees more than span keys but every distance is seen")
    ap.add_argument("--reach", type=int, default=None,
                    help="with --far: the farthest distance a drawn key may lie from its window's last row "
                         "(default: the sequence length - 1)")
    ap.add_argument("--match", type=int, default=0,
                    help="with --far: up to this many of the drawn keys are match keys (earlier positions whose "
                         "bigram a window row reads: the keys a copy needs), the rest uniform")
    ap.add_argument("--copy-share", type=float, default=0.0,
                    help="share of the windows drawn from recall sequences (features with a copied mask) in "
                         "proportion to their copied tokens within the head's reach; the rest uniform")
    ap.add_argument("--copy-weight", type=float, default=1.0,
                    help="loss weight of the rows whose guessed token is copied (recall sequences), the others 1")
    ap.add_argument("--rows", type=int, default=2048, help="head rows per optimiser step")
    ap.add_argument("--ttt", type=int, default=4, help="drafting steps unrolled (training-time test)")
    ap.add_argument("--steps", type=int, default=360)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--chunk", type=int, default=1024, help="query rows per attention chunk")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                    help="bf16: matmuls in bfloat16 under autocast (fp32 weights and optimiser; 8x faster on CPUs "
                         "with AVX-512 BF16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu",
                    help="where the head trains: cpu, or cuda on a GPU machine (features stay in host memory; each "
                         "step's windows are moved over; bf16 autocast runs on the device)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--write-every-save", action="store_true",
                    help="also write the checkpoint folder at every save, so that a run stopped early leaves a "
                         "head (its training_log.json says after how many steps)")
    ap.add_argument("--init", type=Path, default=None,
                    help="continue from a head this script wrote (its folder): its weights, a fresh optimiser and "
                         "schedule of --steps more steps; its record is kept under 'init' in training_log.json")
    args = ap.parse_args()
    init_config = None
    if args.init is not None:
        if not (args.init / "model.safetensors").is_file() or not (args.init / "training_log.json").is_file():
            raise SystemExit(f"--init {args.init}: not a head this script wrote (model.safetensors and "
                             "training_log.json expected); give such a folder")
        if args.init.resolve() == args.out.resolve():
            raise SystemExit(f"--init {args.init} is also --out: write the continued head to another folder")
        config_file = args.init / "config.json"
        init_config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        asked = {"max_position_embeddings": args.span, "draft_vocab_size": args.draft_vocab,
                 "intermediate_size": args.intermediate}
        if any(init_config.get(k) != v for k, v in asked.items()):
            raise SystemExit(f"--init {args.init}: its config.json has {({k: init_config.get(k) for k in asked})}, "
                             f"these options ask for {asked}; give matching --span / --draft-vocab / --intermediate")
    if not 0 <= args.far <= args.span - 2 * args.ttt:
        raise SystemExit(f"--far {args.far}: give 0 (no drawn keys) up to --span - 2 * --ttt = "
                         f"{args.span - 2 * args.ttt}, so windows keep at least --ttt rows of their own")
    if not 0 <= args.match <= args.far:
        raise SystemExit(f"--match {args.match}: give 0 up to --far {args.far}")
    if not 0 <= args.copy_share <= 1:
        raise SystemExit(f"--copy-share {args.copy_share}: give a share from 0 to 1")
    if not (math.isfinite(args.copy_weight) and args.copy_weight > 0):
        raise SystemExit(f"--copy-weight {args.copy_weight}: give a positive weight (1: copied rows weigh as the others)")
    if args.reach is not None and (not args.far or args.reach < args.span):
        raise SystemExit(f"--reach {args.reach}: give it with --far, at least --span {args.span}")
    device = check_device(args.device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    work = args.work or ROOT / ".cache" / f"train-{args.out.name}"
    work.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) for k, v in vars(args).items() if k not in ("out", "work", "threads", "save_every", "write_every_save", "device")}

    target, _ = load_smollm2()
    tc = target.config
    data = load_shards(args.features)
    seq_len = data["tokens"].shape[1]
    if not args.ttt <= args.span <= seq_len:
        raise SystemExit(f"--span {args.span} must lie between --ttt {args.ttt} and the sequence length {seq_len}")
    # windows of `base` rows; their last drafting step sees `base + ttt - 1` keys, and `context` more rows in
    # front of a window (every earlier row of its sequence, up to the span) when the span exceeds a window,
    # or `far` keys drawn from the whole earlier sequence
    base = min(args.span - args.ttt + 1 - args.far, args.rows, seq_len - args.ttt)
    windows = args.rows // base
    context = args.span - args.ttt + 1 - args.far - base
    if args.reach is not None and args.reach >= seq_len:
        raise SystemExit(f"--reach {args.reach}: give at most the sequence length - 1 = {seq_len - 1}")
    if context and windows != 1:
        raise SystemExit(f"--span {args.span} exceeds one window of --rows {args.rows}: give --rows <= --span")
    if args.init is not None:  # a continued head keeps its draft vocabulary, whatever the features
        from safetensors import safe_open
        with safe_open(str(args.init / "model.safetensors"), "pt") as f:
            draft_ids = f.get_tensor("d2t").long() + torch.arange(args.draft_vocab)
    else:
        draft_ids = draft_vocabulary(data["tokens"], tc.vocab_size, args.draft_vocab)
    coverage = torch.isin(data["tokens"], draft_ids).float().mean().item()
    log(f"{data['tokens'].numel()} train tokens in {data['tokens'].shape[0]} sequences of {seq_len}; "
        f"draft vocabulary covers {coverage:.3f} of them")

    rope_theta = float((getattr(tc, "rope_parameters", None) or {}).get("rope_theta", getattr(tc, "rope_theta", 1e4)))
    # the attention's shape is the target's, or a continued head's own (a copy group adds heads: scripts/induction_head.py)
    shape = {"num_attention_heads": tc.num_attention_heads, "num_key_value_heads": tc.num_key_value_heads, "head_dim": 0}
    if init_config is not None:
        shape = {k: init_config.get(k, v) for k, v in shape.items()}
    config = Eagle3Config(hidden_size=tc.hidden_size, intermediate_size=args.intermediate,
                          vocab_size=tc.vocab_size, draft_vocab_size=args.draft_vocab,
                          max_position_embeddings=args.span, rms_norm_eps=tc.rms_norm_eps, rope_theta=rope_theta,
                          **shape)
    head = Eagle3Head(config, embed_tokens=target.get_input_embeddings())
    teacher_w = target.get_output_embeddings().weight.detach()[draft_ids].float()  # (draft_vocab, hidden)
    with torch.no_grad():
        head.lm_head.weight.copy_(teacher_w)
        head.norm.weight.copy_(target.get_decoder().norm.weight)
        head.d2t.copy_(draft_ids - torch.arange(args.draft_vocab))
        head.t2d.zero_()
        head.t2d[draft_ids] = True
    head.embed_tokens.weight.requires_grad_(False)
    previous = None
    if args.init is not None:
        previous = json.loads((args.init / "training_log.json").read_text())
        if init_config != json.loads(json.dumps(config.to_dict())):
            raise SystemExit(f"--init {args.init} has another shape or n_ref than these options "
                             f"({init_config} against {config.to_dict()})")
        from safetensors.torch import load_file
        missing, unexpected = head.load_state_dict(
            {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(args.init / "model.safetensors")).items()},
            strict=False)
        if unexpected or [k for k in missing if not k.startswith("embed_tokens")]:
            raise SystemExit(f"--init {args.init}: weights do not match (missing {missing}, unexpected {unexpected})")
        if not torch.equal(head.d2t, draft_ids - torch.arange(args.draft_vocab)):
            raise SystemExit(f"--init {args.init} has another draft vocabulary than these features")
        log(f"continuing from {args.init} ({_steps_of(previous)} steps)")
    reach = args.span if not args.far else (args.reach or seq_len - 1)  # how far back a training query can see
    weights = copy_weights(data, args.copy_share, reach)
    if args.copy_share:
        log("copy share: " + ("no sequence has copies within reach; windows drawn uniformly" if weights is None else
                              f"{int((weights > weights.min()).sum())} sequences with copies within {reach} keys"))
    head.to(device)
    teacher_w = teacher_w.to(device)
    params = [p for n, p in head.named_parameters() if not n.startswith("embed_tokens")]
    opt, sched = optimiser(params, args.lr, args.steps)
    gen = torch.Generator().manual_seed(args.seed)
    progress, parts = work / "progress.pt", {"head": head, "opt": opt, "sched": sched}
    history, done, seconds = resume(progress, settings, parts, gen)
    if done:
        log(f"resuming at step {done}/{args.steps}")

    t0 = time.time() - seconds
    ema = RunningMean(0.8)
    for step in range(done + 1, args.steps + 1):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            batch = sample_windows(gen, data, windows, base, args.ttt, context, args.far, args.reach, weights,
                                   args.match, copied=args.copy_weight != 1)
            row_weights = None if args.copy_weight == 1 else (1 + (args.copy_weight - 1) * batch[5].float()).to(device)
            batch = (*(t.to(device) for t in batch[:4]), batch[4])
            loss, agreement = unrolled_loss(head, teacher_w, batch,
                                            args.ttt, args.chunk, row_weights)
        descend(params, opt, sched, loss)
        mean = ema.record(history, step, loss.item(), agreement, t0)
        log(f"step {step}/{args.steps} loss {mean[0]:.3f} agreement per drafting step "
            + " ".join(f"{a:.3f}" for a in mean[1:]) + f" ({time.time() - t0:.0f} s)")
        if step % args.save_every == 0 or step == args.steps:
            save_progress(progress, settings, parts, gen, history, step, time.time() - t0)
            if args.write_every_save or step == args.steps:
                write_head(args, config, head, history, step, time.time() - t0, previous,
                           {"seq_len": seq_len, "train_tokens": data["tokens"].numel(),
                            "draft_vocab_coverage": round(coverage, 4)})
    log(f"saved {args.out} ({(args.out / 'model.safetensors').stat().st_size / 2**20:.1f} MiB)")


def write_head(args, config: Eagle3Config, head: Eagle3Head, history: list[dict], step: int, seconds: float,
               previous: dict | None, data_record: dict) -> None:
    """The checkpoint folder after ``step`` optimiser steps: config.json, model.safetensors (fp16, no
    ``embed_tokens``) and training_log.json, each written atomically."""
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_text(args.out / "config.json", json.dumps(config.to_dict(), indent=2) + "\n")
    state = {k: (v.half() if v.is_floating_point() else v).cpu().contiguous()
             for k, v in head.state_dict().items() if not k.startswith("embed_tokens")}
    atomic_weights(state, args.out / "model.safetensors")
    manifest = json.loads((args.features / "manifest.json").read_text())
    record = {"command": "python scripts/train_demo_eagle3.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                  if k not in ("out", "features", "work", "save_every", "write_every_save"))
              + f" --out {args.out.name}",
              "n_ref": args.span, "corpus": manifest["per_source"], **data_record,
              "steps_done": step, "train_seconds": round(seconds, 1),
              "steps_total": step + (_steps_of(previous) if previous else 0),
              "train_seconds_total": round(seconds + (
                  _seconds_of(previous) if previous else 0), 1),
              "torch": torch.__version__, "threads": args.threads,
              "history": history[::10] + ([history[-1]] if len(history) % 10 != 1 else [])}
    if args.far:
        record["max_distance"] = args.reach or data_record["seq_len"] - 1
    if previous is not None:
        record["init"] = {"from": args.init.name, **previous}
    atomic_text(args.out / "training_log.json", json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
