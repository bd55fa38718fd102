"""Train the demo EAGLE-3 head for SmolLM2-135M-Instruct shipped in ``calibrate/assets/eagle3-smollm2``.

The head is a real EAGLE-3 drafter (Li et al., 2025, arXiv:2503.01840; one decoder layer over the
target's low / middle / high hidden states, official checkpoint layout) trained at a short context,
``n_ref = 256``, so that the whole SharpDraft loop (calibrate, eval) runs on a CPU and shows attention
dilution past the training length.

What it does, seeded and deterministic given the same torch build and thread count:

1. Target features. The pydoc **train** split (``calibrate.corpus``, the calibration split; the
   held-out topics are never read) is packed into sequences of ``--seq-len`` (2048) tokens; over
   the first ``--sequences`` (16, about 33k tokens: the CPU budget) SmolLM2 runs once each,
   keeping ``hidden_states[2, 15, 27]`` (the EAGLE-3 features) and the final normed state (the
   teacher). Cached in fp16 under ``.cache/`` (about 150 MB; delete it after changing the data
   options).
2. Draft vocabulary. The ``--draft-vocab`` (4096) most frequent target tokens of those sequences,
   sorted by target id: ``d2t[i] = target_id - i``, ``t2d[target_id] = True``, as EAGLE-3 builds it.
3. Training. Each example is a window of ``n_ref`` consecutive head rows taken at a random offset
   inside a 2048-token sequence, with its **true** position ids. The head's attention span is
   therefore ``n_ref`` (what dilution is measured against), while RoPE sees positions 0..2047, so
   at evaluation long contexts differ from training only in how many keys a query sees, not in
   rotation angles never seen in training (EAGLE-3 itself trains with positions 0..max_len; with
   positions 0..255 only, long-context results would mix RoPE extrapolation into the dilution).
   Loss: cross-entropy to the target's next-token distribution restricted to the draft vocabulary
   and renormalised (teacher logits = final hidden state @ the target's lm_head rows of the draft
   vocabulary). One-step training only (no training-time test): later drafting steps, which feed
   the head's own output back as the feature, are weaker than in EAGLE-3's released heads.
   ``lm_head`` and ``norm`` start from the target's rows / final norm; everything else is random.
4. Save ``config.json`` (``max_position_embeddings = n_ref``) and ``model.safetensors`` in fp16
   without ``embed_tokens`` (the target's embedding is shared), plus the training log as JSON.

Usage (about 23 minutes on 2 busy CPU cores: 15 for the features, 8 for training)::

    python scripts/train_demo_eagle3.py --out calibrate/assets/eagle3-smollm2
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from calibrate.corpus import pack
from calibrate.drafters.eagle3 import Eagle3Config, Eagle3Head, feature_layer_ids
from calibrate.drafters.target import eos_token_id, hidden_state_features
from calibrate.smollm2 import load_smollm2

ROOT = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@torch.no_grad()
def build_features(target, tokenizer, seq_len: int, limit: int, cache: Path) -> dict[str, torch.Tensor]:
    """tokens (S, T) int64, features (S, T, 3 * hidden) fp16, final (S, T, hidden) fp16; cached."""
    if cache.is_file():
        log(f"features: reading {cache}")
        return torch.load(cache, weights_only=True)
    sequences = list(pack("pydoc:train", lambda t: tokenizer.encode(t, add_special_tokens=False),
                          eos_token_id(tokenizer), seq_len, limit))
    num_layers = len(target.get_decoder().layers)
    ids = (*feature_layer_ids(num_layers), num_layers)
    tokens = torch.tensor(sequences)
    feats, finals = [], []
    t0 = time.time()
    for i in range(len(sequences)):
        out = hidden_state_features(target, tokens[i:i + 1], ids)[0]  # (T, 4 * hidden)
        width = out.shape[-1] // 4
        feats.append(out[:, :3 * width].half())
        finals.append(out[:, 3 * width:].half())
        log(f"features: sequence {i + 1}/{len(sequences)} ({time.time() - t0:.0f} s)")
    data = {"tokens": tokens, "features": torch.stack(feats), "final": torch.stack(finals)}
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save(data, cache)
    return data


def draft_vocabulary(tokens: torch.Tensor, vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids of ``tokens`` (ties: lower id first), sorted by id."""
    counts = torch.bincount(tokens.flatten(), minlength=vocab_size).double()
    counts -= torch.arange(vocab_size, dtype=torch.float64) * 1e-9  # deterministic tie break
    return torch.sort(torch.topk(counts, size).indices).values


def sample_windows(gen: torch.Generator, data: dict, batch: int, n_ref: int):
    """Random windows of ``n_ref`` head rows with true positions: row t = (feature t, token t+1) -> t+2."""
    S, T = data["tokens"].shape
    seq = torch.randint(0, S, (batch,), generator=gen)
    start = torch.randint(0, T - n_ref - 1, (batch,), generator=gen)  # rows t .. t + n_ref - 1, t + n_ref < T
    pos = start[:, None] + torch.arange(n_ref)  # (B, n_ref)
    s = seq[:, None]
    return (data["tokens"][s, pos + 1], data["features"][s, pos].float(),
            data["final"][s, pos + 1].float(), pos)


def soft_loss(head, teacher_w, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy to the renormalised draft-vocabulary target distribution, and top-1 agreement."""
    input_ids, features, final, pos = batch
    logits = head(input_ids, features, position_ids=pos).logits.float()  # (B, T, draft_vocab)
    with torch.no_grad():
        target_p = torch.softmax(final @ teacher_w.T, dim=-1)  # (B, T, draft_vocab)
    loss = -(target_p * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
    agree = (logits.argmax(-1) == target_p.argmax(-1)).float().mean()
    return loss, agree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "calibrate" / "assets" / "eagle3-smollm2")
    ap.add_argument("--cache", type=Path, default=ROOT / ".cache" / "eagle3-smollm2-train-features.pt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-ref", type=int, default=256, help="attention span of a training window")
    ap.add_argument("--seq-len", type=int, default=2048, help="target context of the features")
    ap.add_argument("--sequences", type=int, default=16, help="first N packed train sequences used")
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=4, help="windows per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.time()

    target, tokenizer = load_smollm2()
    tc = target.config
    data = build_features(target, tokenizer, args.seq_len, args.sequences, args.cache)
    feature_s = time.time() - started
    draft_ids = draft_vocabulary(data["tokens"], tc.vocab_size, args.draft_vocab)
    coverage = torch.isin(data["tokens"], draft_ids).float().mean().item()
    log(f"{data['tokens'].numel()} train tokens in {data['tokens'].shape[0]} sequences; "
        f"draft vocabulary covers {coverage:.3f} of them")

    rope_theta = float((getattr(tc, "rope_parameters", None) or {}).get("rope_theta", getattr(tc, "rope_theta", 1e4)))
    config = Eagle3Config(hidden_size=tc.hidden_size, num_attention_heads=tc.num_attention_heads,
                          num_key_value_heads=tc.num_key_value_heads, intermediate_size=args.intermediate,
                          vocab_size=tc.vocab_size, draft_vocab_size=args.draft_vocab,
                          max_position_embeddings=args.n_ref, rms_norm_eps=tc.rms_norm_eps, rope_theta=rope_theta)
    head = Eagle3Head(config, embed_tokens=target.get_input_embeddings())
    teacher_w = target.get_output_embeddings().weight.detach()[draft_ids].float()  # (draft_vocab, hidden)
    with torch.no_grad():
        head.lm_head.weight.copy_(teacher_w)
        head.norm.weight.copy_(target.get_decoder().norm.weight)
        head.d2t.copy_(draft_ids - torch.arange(args.draft_vocab))
        head.t2d.zero_()
        head.t2d[draft_ids] = True
    head.embed_tokens.weight.requires_grad_(False)
    params = [p for n, p in head.named_parameters() if not n.startswith("embed_tokens")]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    gen = torch.Generator().manual_seed(args.seed)
    history = []
    t0 = time.time()
    ema_loss = ema_agree = None
    for step in range(1, args.steps + 1):
        loss, agree = soft_loss(head, teacher_w, sample_windows(gen, data, args.batch, args.n_ref))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        ema_loss = loss.item() if ema_loss is None else 0.9 * ema_loss + 0.1 * loss.item()
        ema_agree = agree.item() if ema_agree is None else 0.9 * ema_agree + 0.1 * agree.item()
        if step % 20 == 0 or step == 1:
            history.append({"step": step, "loss": round(ema_loss, 4), "agreement": round(ema_agree, 4),
                            "seconds": round(time.time() - t0, 1)})
            log(f"step {step}/{args.steps} loss {ema_loss:.4f} top-1 agreement {ema_agree:.3f} "
                f"({time.time() - t0:.0f} s)")

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    from safetensors.torch import save_file
    state = {k: (v.half() if v.is_floating_point() else v).contiguous()
             for k, v in head.state_dict().items() if not k.startswith("embed_tokens")}
    save_file(state, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    record = {"command": "python scripts/train_demo_eagle3.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "cache")),
              "seed": args.seed, "n_ref": args.n_ref, "seq_len": args.seq_len, "corpus": "pydoc:train",
              "train_tokens": data["tokens"].numel(), "draft_vocab_coverage": round(coverage, 4),
              "feature_seconds": round(feature_s, 1), "train_seconds": round(time.time() - t0, 1),
              "torch": torch.__version__, "threads": args.threads, "history": history}
    (args.out / "training_log.json").write_text(json.dumps(record, indent=1) + "\n")
    log(f"saved {args.out} ({(args.out / 'model.safetensors').stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
