"""Train a DFlash head for SmolLM2-135M-Instruct (``calibrate/assets/dflash-smollm2``, ``--drafter dflash``).

DFlash (z-lab, arXiv:2602.06036) drafts a block in one forward: the anchor token and ``B - 1`` mask
tokens attend, non-causally inside the block, to fused target features of the context
(``calibrate/drafters/dflash.py``). The recipe follows DFlash's as SpecForge trains it:

1. Target features: the shards of ``scripts/target_features.py`` (SmolLM2's ``hidden_states[2, 15,
   27]``, evenly spaced over its 30 layers, and the final normed state). They are the outputs of
   layers ``target_layer_ids = (1, 14, 26)``, z-lab's reading (``hidden_states[id + 1]``), so the
   EAGLE-3 heads' features serve unchanged.
2. Random anchors: each step draws ``--anchors`` positions ``p`` of one sequence; the block at ``p``
   is token ``x_p`` then ``B - 1`` copies of ``--mask-token`` (SmolLM2's ``<empty_output>``, id 16,
   which the corpora never contain) at positions ``p .. p + B - 1``. All blocks of a step run in one
   forward with per-block masks (``calibrate.drafters.blocks.anchored_masks``' layout): a block sees
   its own context keys and its own rows only.
3. Context keys: at most ``--context`` per block, chosen over the whole earlier sequence so that the
   keys a copy needs can be among them: the ``--local`` positions just before ``p``, then from the
   earlier ones up to ``--match`` **match spans** (an earlier position ``j`` whose token pair
   ``(x_{j-1}, x_j)`` is the block's ``(x_{p-1}, x_p)``, with the ``B - 1`` positions after it, what
   the block's rows would copy from), the rest drawn uniformly. Past ``--context`` keys a block then
   meets the keys it used in training plus more background keys: dilution alone, the regime the
   query scale is for (``n_ref = --context + B``, the most keys a block query saw; every distance up
   to the sequence length was seen).
4. Loss: row ``k`` of a block (``k = 1 .. B - 1``) guesses token ``p + k``; its cross-entropy against
   the target's next-token law there (final state at ``p + k - 1`` times the target's ``lm_head``)
   is weighted ``exp(-(k - 1) / --decay)`` (DFlash's decay, 7 for blocks of 16). The target's
   embedding and ``lm_head`` are frozen and not saved; ``fc``, ``hidden_norm``, the Qwen3-style
   layers and ``norm`` train: from a random start (``norm`` at ones, DFlash's), or with
   ``--layer-init target`` from a copy of the target's last layers (:func:`target_start`).
5. Progress is saved every ``--save-every`` steps under ``--work`` (atomically; a stopped run
   resumes). The head folder: ``config.json`` (z-lab's layout), ``model.safetensors`` (fp16) and
   ``training_log.json`` (``n_ref``, ``max_distance``, the command and the loss history).

Usage (features first; ``--device cuda`` on a GPU machine, where it takes minutes)::

    python scripts/target_features.py --sources recall:pydoc:train,recall:stdlib --per-source 100,220 \\
        --seq-len 1024 --tokens 327680 --out .cache/smollm2-features-recall-1024
    python scripts/train_dflash.py --features .cache/smollm2-features-recall-1024 --out .cache/heads/dflash-smollm2
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from ..drafters.blocks import block_ids
from ..drafters.dflash import DFlashConfig, DFlashDraftModel
from ..smollm2 import load_smollm2
from .common import (ROOT, RunningMean, atomic_text, atomic_weights, check_device, descend, log, optimiser, resume,
                     save_progress)
from .features import load_shards
from .loss import distillation_loss

TARGET_LAYER_IDS = (1, 14, 26)  # read as hidden_states[2, 15, 27]: the shards' features
SETTINGS_BEFORE = {"layer_init": "random"}  # options added later, as runs saved before them had them


@torch.no_grad()
def target_start(model: DFlashDraftModel, target, features: torch.Tensor) -> dict[int, tuple[float, float]]:
    """Start ``model`` from the target's last layers, so that the block rows begin near the target's own
    next-token path; returns, per target layer copied, the q_norm / k_norm weights given.

    Layer ``i`` of ``L`` is a copy of the target's layer ``N - L + i`` (attention projections, MLP, both
    norms); ``fc`` passes the last feature (the output of target layer ``TARGET_LAYER_IDS[-1]``) through and
    ``hidden_norm`` is the first copied layer's input norm, so that layer sees context keys and values of the
    target's residual stream as the target's layer would; ``norm`` is the target's final norm. The target has
    no per-head q/k norm: each copy's ``q_norm`` / ``k_norm`` weights are set to the root mean square of the
    target layer's queries / keys on ``features`` (T, len(ids) * H), so the attention logits start at the
    target's scale.
    """
    c = model.config
    source = target.get_decoder().layers
    first = len(source) - c.num_hidden_layers
    H = c.hidden_size
    model.fc.weight.zero_()
    model.fc.weight[:, -H:] = torch.eye(H)
    model.hidden_norm.weight.copy_(source[first].input_layernorm.weight)
    model.norm.weight.copy_(target.get_decoder().norm.weight)
    resid = features[:, -H:]
    scales = {}
    for index, (layer, src) in enumerate(zip(model.layers, source[first:]), start=first):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(layer.self_attn, name).load_state_dict(getattr(src.self_attn, name).state_dict())
        layer.mlp.load_state_dict(src.mlp.state_dict())
        layer.input_layernorm.load_state_dict(src.input_layernorm.state_dict())
        layer.post_attention_layernorm.load_state_dict(src.post_attention_layernorm.state_dict())
        x = src.input_layernorm(resid)
        rms = [float(proj(x).pow(2).mean().sqrt()) for proj in (src.self_attn.q_proj, src.self_attn.k_proj)]
        layer.self_attn.q_norm.weight.fill_(rms[0])
        layer.self_attn.k_norm.weight.fill_(rms[1])
        scales[index] = tuple(rms)
    return scales


def context_keys(gen: torch.Generator, tokens: torch.Tensor, p: int, context: int, local: int, match: int,
                 block: int) -> torch.Tensor:
    """Bool (T,): the context positions the block at ``p`` sees (module docstring, step 3).

    >>> t = torch.tensor([5, 6, 7, 1, 2, 9, 9, 9, 1, 2, 0, 0])
    >>> context_keys(torch.Generator().manual_seed(0), t, 9, 3, 1, 1, 2).nonzero().flatten().tolist()
    [4, 5, 8]
    """
    seen = torch.zeros(len(tokens), dtype=torch.bool)
    seen[max(0, p - local):p] = True
    lowest = p - local  # earlier positions: [0, lowest)
    if lowest <= 0 or context <= local:
        return seen
    budget = min(context - local, lowest)
    if match and p >= 1:
        j = torch.arange(1, lowest)
        hits = j[(tokens[j] == tokens[p]) & (tokens[j - 1] == tokens[p - 1])]
        hits = hits[torch.randperm(len(hits), generator=gen)[:match]]
        for h in hits.tolist():
            span = torch.arange(h, min(h + block - 1, lowest))
            take = span[~seen[span]][:budget - int(seen[:lowest].sum())]
            seen[take] = True
    left = budget - int(seen[:lowest].sum())
    if left > 0:
        free = (~seen[:lowest]).nonzero().flatten()
        seen[free[torch.randperm(len(free), generator=gen)[:left]]] = True
    return seen


def block_loss(model: DFlashDraftModel, embed, lm_head: torch.Tensor, data: dict, seq: int, anchors: torch.Tensor,
               seen: torch.Tensor, decay: float) -> tuple[torch.Tensor, list[float]]:
    """Weighted cross-entropy of the blocks at ``anchors`` (A,) of sequence ``seq`` against the target's
    laws, and greedy agreement per block row 1 .. B - 1 (for the log)."""
    c = model.config
    B, A = c.block_size, len(anchors)
    device, dtype = lm_head.device, lm_head.dtype
    tokens = data["tokens"][seq].to(device)
    T = len(tokens)
    features = data["features"][seq][None].to(device, dtype)  # (1, T, 3H)
    context = model.encode_context(features, torch.arange(T, device=device)[None])
    ids, pos = block_ids(model, anchors, tokens[anchors])  # (1, A * B) each, as the block drafter builds them
    own = torch.arange(A, device=device).repeat_interleave(B)
    visible = torch.cat((seen.to(device).repeat_interleave(B, dim=0), own[:, None] == own[None, :]), dim=1)
    noise = embed(ids).to(dtype) * c.input_embedding_scale  # as calibrate.drafters.blocks embeds a block
    hidden = model.forward_block(noise, pos, context,
                                 [visible[None, None]] * c.num_hidden_layers)  # (1, A * B, H)
    rows = hidden.view(A, B, -1)[:, 1:]  # (A, B - 1, H): row k guesses token p + k
    logits = rows @ lm_head.T  # (A, B - 1, vocab)
    where = anchors[:, None] + torch.arange(B - 1, device=device)  # (A, B - 1): final state at p + k - 1
    with torch.no_grad():
        teacher = data["final"][seq].to(device, dtype)[where] @ lm_head.T  # (A, B - 1, vocab)
        p_t = teacher.softmax(-1)
    ce = distillation_loss(logits, p_t)  # (A, B - 1)
    weights = torch.exp(-torch.arange(B - 1, device=device, dtype=dtype) / decay)
    loss = (ce * weights).sum(-1).mean() / weights.sum()
    agree = (logits.argmax(-1) == teacher.argmax(-1)).float().mean(0)  # (B - 1,)
    return loss, agree.tolist()


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="head folder to write")
    ap.add_argument("--features", required=True,
                    help="shard folder of scripts/target_features.py, or several, comma-separated (the held-out "
                         "check comes from the first)")
    ap.add_argument("--work", type=Path, default=None, help="progress folder (default .cache/train-<out name>)")
    ap.add_argument("--layers", type=int, default=2, help="Qwen3-style decoder layers")
    ap.add_argument("--block", type=int, default=16, help="block size B: the anchor and B - 1 drafts")
    ap.add_argument("--context", type=int, default=256, help="context keys a block sees at most")
    ap.add_argument("--local", type=int, default=128, help="of them, the positions just before the anchor")
    ap.add_argument("--match", type=int, default=4, help="match spans among the earlier keys")
    ap.add_argument("--anchors", type=int, default=16, help="blocks per optimiser step (one sequence)")
    ap.add_argument("--decay", type=float, default=7.0, help="row k weighs exp(-(k - 1) / decay)")
    ap.add_argument("--mask-token", type=int, default=16, help="the mask token id (SmolLM2's <empty_output>)")
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--norm-init", choices=("ones", "target"), default="ones",
                    help="the output norm's weights at the start: ones (DFlash's), or the target's final norm")
    ap.add_argument("--layer-init", choices=("random", "target"), default="random",
                    help="the layers at the start: random (DFlash's), or a copy of the target's last --layers "
                         "layers, fc reading the last feature and the output norm the target's (target_start)")
    ap.add_argument("--check", type=int, default=8,
                    help="sequences kept out of training, evenly spaced over the shards, checked every --check-every")
    ap.add_argument("--check-every", type=int, default=50, help="steps between held-out checks")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--save-every", type=int, default=25)
    ap.add_argument("--write-every-save", action="store_true", help="write the head folder at every save")
    args = ap.parse_args(argv)
    for name, least in (("layers", 1), ("block", 2), ("context", 1), ("local", 1), ("match", 0), ("anchors", 1),
                        ("steps", 1), ("save_every", 1), ("threads", 1), ("check", 0),
                        ("check_every", 1)):
        if getattr(args, name) < least:
            raise SystemExit(f"--{name.replace('_', '-')} {getattr(args, name)}: need at least {least}")
    if args.local > args.context:
        raise SystemExit(f"--local {args.local}: at most --context {args.context}")
    if not (args.decay > 0 and math.isfinite(args.decay)) or not (args.lr > 0 and math.isfinite(args.lr)):
        raise SystemExit(f"--decay {args.decay} / --lr {args.lr}: give positive numbers")
    args.feature_dirs = [Path(f) for f in args.features.split(",")]
    if len(set(f.resolve() for f in args.feature_dirs)) < len(args.feature_dirs) or "" in args.features.split(","):
        raise SystemExit(f"--features {args.features}: name each shard folder once")
    for folder in args.feature_dirs:
        if args.out.resolve() == folder.resolve():
            raise SystemExit(f"--out {args.out} is also --features: write the head to another folder")
        if not (folder / "manifest.json").is_file():
            raise SystemExit(f"--features {folder}: no manifest.json; run scripts/target_features.py first")
    if args.out.exists() and not args.out.is_dir():
        raise SystemExit(f"--out {args.out}: a file, not a folder; give a folder for the head")
    manifests = [json.loads((folder / "manifest.json").read_text()) for folder in args.feature_dirs]
    if len({m.get("seq_len") for m in manifests}) > 1:
        raise SystemExit(f"--features {args.features}: the folders hold sequences of different lengths ("
                         + ", ".join(str(m.get("seq_len")) for m in manifests) + "); give folders of one length")
    sequences = manifests[0].get("sequences", 0)
    if args.check >= sequences:
        raise SystemExit(f"--check {args.check}: the first shard folder holds {sequences} sequences; keep fewer out "
                         "for the check")
    return args


def held_out(sequences: int, check: int) -> list[int]:
    """The ``check`` sequences kept out of training, evenly spaced so that every source of the mix is among them.

    >>> held_out(10, 3)
    [1, 5, 8]
    """
    return [int((i + 0.5) * sequences / check) for i in range(check)]


def draw_blocks(gen: torch.Generator, tokens: torch.Tensor, args: argparse.Namespace):
    """``--anchors`` random anchors ``p`` in ``[1, T - B]`` of one sequence (sorted) and the context keys each block
    sees (:func:`context_keys`): (A,) and (A, T)."""
    anchors = torch.randperm(len(tokens) - args.block, generator=gen)[:args.anchors].sort().values + 1
    seen = torch.stack([context_keys(gen, tokens, int(p), args.context, args.local, args.match, args.block)
                        for p in anchors])
    return anchors, seen


@torch.no_grad()
def check_blocks(model: DFlashDraftModel, embed, lm_head: torch.Tensor, data: dict, seqs: list[int],
                 args: argparse.Namespace) -> dict:
    """The loss and greedy agreement per block row on held-out sequences, at anchors and keys drawn from a fixed
    seed (the same at every check), so that checks along a run compare the same blocks."""
    gen = torch.Generator().manual_seed(12345)
    losses, agree = [], []
    for seq in seqs:
        anchors, seen = draw_blocks(gen, data["tokens"][seq], args)
        loss, rows = block_loss(model, embed, lm_head, data, seq, anchors.to(lm_head.device), seen, args.decay)
        losses.append(loss.item())
        agree.append(rows)
    rows = torch.tensor(agree).mean(0).tolist()
    return {"loss": round(sum(losses) / len(losses), 4), "agreement": [round(a, 4) for a in rows]}


def main(argv=None) -> None:
    args = parse_args(argv)
    device = check_device(args.device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    work = args.work or ROOT / ".cache" / f"train-{args.out.name}"
    settings = {k: str(v) for k, v in vars(args).items()
                if k not in ("out", "work", "threads", "save_every", "write_every_save", "device", "check_every",
                             "feature_dirs")}

    target, _ = load_smollm2()
    tc = target.config
    if not 0 <= args.mask_token < tc.vocab_size:
        raise SystemExit(f"--mask-token {args.mask_token}: not a token id of the target's {tc.vocab_size}")
    if args.layer_init == "target" and (args.intermediate != tc.intermediate_size
                                        or args.layers > tc.num_hidden_layers):
        raise SystemExit(f"--layer-init target copies the target's layers: give --intermediate "
                         f"{tc.intermediate_size} and at most {tc.num_hidden_layers} --layers")
    parts = [load_shards(folder) for folder in args.feature_dirs]
    first = len(parts[0]["tokens"])  # the held-out check is drawn from the first folder
    data = {key: torch.cat([part[key] for part in parts]) for key in parts[0]}
    del parts
    S, T = data["tokens"].shape
    if T < args.block + 2:
        raise SystemExit(f"--block {args.block}: the sequences hold {T} tokens; give a smaller block")
    rope = (getattr(tc, "rope_parameters", None) or {}).get("rope_theta", getattr(tc, "rope_theta", 1e4))
    config = DFlashConfig(hidden_size=tc.hidden_size, num_attention_heads=tc.num_attention_heads,
                          num_key_value_heads=tc.num_key_value_heads, intermediate_size=args.intermediate,
                          num_hidden_layers=args.layers, vocab_size=tc.vocab_size, block_size=args.block,
                          mask_token_id=args.mask_token, target_layer_ids=TARGET_LAYER_IDS,
                          rms_norm_eps=tc.rms_norm_eps, rope_theta=float(rope),
                          num_target_layers=tc.num_hidden_layers)
    model = DFlashDraftModel(config)
    if args.layer_init == "target":
        scales = target_start(model, target, data["features"][0][:256].float())
        log("layers from the target's " + ", ".join(str(s) for s in scales) + "; q_norm / k_norm at "
            + ", ".join(f"{q:.2f} / {k:.2f}" for q, k in scales.values()))
    if args.norm_init == "target":  # logits at the target's scale, but in a random direction: a large first loss
        with torch.no_grad():
            model.norm.weight.copy_(target.get_decoder().norm.weight)
    model = model.to(device)
    embed = target.get_input_embeddings().to(device)
    lm_head = target.get_output_embeddings().weight.detach().float().to(device)
    params = list(model.parameters())
    log(f"{S} sequences of {T} tokens; {sum(p.numel() for p in params) / 1e6:.1f} M parameters; "
        f"{args.layers} layers, block {args.block}, at most {args.context} context keys")
    opt, sched = optimiser(params, args.lr, args.steps)
    gen = torch.Generator().manual_seed(args.seed)
    checked = held_out(first, args.check) if args.check else []
    train = torch.tensor([i for i in range(S) if i not in set(checked)])
    work.mkdir(parents=True, exist_ok=True)
    progress, parts = work / "progress.pt", {"model": model, "opt": opt, "sched": sched}
    history, done, seconds = resume(progress, settings, parts, gen, SETTINGS_BEFORE)  # an older run keeps the default
    if done:
        log(f"resuming at step {done}/{args.steps}")
    t0 = time.time() - seconds
    ema = RunningMean(0.9)
    for step in range(done + 1, args.steps + 1):
        seq = int(train[torch.randint(0, len(train), (1,), generator=gen)])
        anchors, seen = draw_blocks(gen, data["tokens"][seq], args)
        loss, agree = block_loss(model, embed, lm_head, data, seq, anchors.to(device), seen, args.decay)
        descend(params, opt, sched, loss)
        mean = ema.record(history, step, loss.item(), agree, t0)
        log(f"step {step}/{args.steps} loss {mean[0]:.3f} agreement rows 1-4 "
            + " ".join(f"{a:.3f}" for a in mean[1:5]) + f" ({time.time() - t0:.0f} s)")
        if checked and (step % args.check_every == 0 or step == args.steps):
            model.eval()
            history[-1]["check"] = check_blocks(model, embed, lm_head, data, checked, args)
            model.train()
            log(f"check on {len(checked)} held-out sequences: loss {history[-1]['check']['loss']:.3f} agreement rows "
                "1-4 " + " ".join(f"{a:.3f}" for a in history[-1]["check"]["agreement"][:4]))
        if step % args.save_every == 0 or step == args.steps:
            save_progress(progress, settings, parts, gen, history, step, time.time() - t0)
            if args.write_every_save or step == args.steps:
                write_head(args, config, model, history, step, time.time() - t0, T, checked)
    log(f"saved {args.out}")


def write_head(args, config: DFlashConfig, model: DFlashDraftModel, history: list[dict], step: int,
               seconds: float, seq_len: int, checked: list[int]) -> None:
    """config.json, model.safetensors (fp16) and training_log.json, each written atomically."""
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_text(args.out / "config.json", json.dumps(config.to_dict(), indent=2) + "\n")
    state = {k: v.half().cpu().contiguous() for k, v in model.state_dict().items()}
    atomic_weights(state, args.out / "model.safetensors")
    corpus: dict[str, int] = {}
    for folder in args.feature_dirs:
        for source, count in (json.loads((folder / "manifest.json").read_text()).get("per_source") or {}).items():
            corpus[source] = corpus.get(source, 0) + count
    record = {"command": "python scripts/train_dflash.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                  if k not in ("out", "work", "save_every", "write_every_save", "feature_dirs") and v is not False)
              + f" --out {args.out.name}",
              "n_ref": args.context + args.block, "max_distance": seq_len - 1,
              "key_rule": f"at most {args.context} context keys per block: the {args.local} before the anchor, up to "
                          f"{args.match} match spans and uniform others over the whole earlier sequence",
              "corpus": corpus, "seq_len": seq_len, "steps_done": step,
              "train_seconds": round(seconds, 1), "torch": torch.__version__, "threads": args.threads,
              "held_out": checked,
              "history": [h for i, h in enumerate(history) if i % 10 == 0 or "check" in h or i == len(history) - 1]}
    atomic_text(args.out / "training_log.json", json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
