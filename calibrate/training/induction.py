"""Give an EAGLE-3 head a copy circuit (calibrate.drafters.induction), fitted on target features.

Gradient descent from a random start has to find an induction match from a plateau, which a CPU does
not reach in hours (docs/training.md). This builds the circuit instead and fits each of its maps on
its own, with the head's weights left as they are:

1. codes: the top ``2 * --pairs`` whitened principal directions of the head's embedding half over the
   token occurrences of the fitting shards;
2. key map: a ridge regression from the hidden half (the target feature, through ``fc`` and
   ``hidden_norm``) to the code of the row's own token (row ``i``: token ``i``);
3. query and key maps refined together: each row's attention over its last ``--window`` rows, with
   RoPE in the lowest-frequency pairs as the head applies it, trained to land on the rows that hold
   its known token (``--epochs`` passes, Adam; the progress is saved after each, and a rerun resumes);
4. value: the top ``head_dim`` directions of the embedding half; output: fitted so that the head's
   ``norm`` and ``lm_head`` read a value back as its own token;
5. the output's scale: each of ``--scales`` (and 0, the head as it was) measured by teacher-forced
   agreement with the target's greedy token on the last ``--check`` shards, which no map was fitted
   on; the best overall is written, or ``--scale``.

    python scripts/induction_head.py --head calibrate/assets/eagle3-smollm2 \\
        --features .cache/smollm2-features-recall-1024 --out .cache/heads/eagle3-smollm2-induction
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from ..drafters.eagle3 import load_eagle3_head
from ..drafters.induction import match_loss, rotate_codes, with_copy_group
from ..drafters.layers import rope_inv_freq
from ..errors import UserError
from .common import ROOT, atomic_save, atomic_text, atomic_weights, log


def positive_floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give positive numbers separated by commas, e.g. 0.5,1,2")
    return values


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", type=Path, default=ROOT / "calibrate" / "assets" / "eagle3-smollm2",
                    help="the EAGLE-3 head to extend (its folder; never written)")
    ap.add_argument("--features", type=Path, default=ROOT / ".cache" / "smollm2-features-recall-1024",
                    help="shard folder of scripts/target_features.py (recall sequences teach the match)")
    ap.add_argument("--out", type=Path, required=True, help="folder of the extended head")
    ap.add_argument("--work", type=Path, default=None, help="progress folder (default .cache/induction-<out name>)")
    ap.add_argument("--pairs", type=int, default=16, help="lowest-frequency RoPE pairs the codes use (2 per pair)")
    ap.add_argument("--window", type=int, default=None,
                    help="rows a query sees while fitting (default: the head's max_position_embeddings, its n_ref)")
    ap.add_argument("--epochs", type=int, default=8, help="passes of the query/key refinement over the shards")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--check", type=int, default=20,
                    help="shards kept out of every fit, for choosing the scale: the last of --features, or the first "
                         "of --check-features")
    ap.add_argument("--check-features", type=Path, default=None,
                    help="a shard folder of held-out text to choose the scale on (target_features.py --sources "
                         "recall:pydoc:heldout, say), so the choice is not made on text the head was trained on; "
                         "every --features shard is then fitted on")
    ap.add_argument("--scales", type=positive_floats, default=[0.5, 1.0, 2.0, 4.0],
                    help="output scales tried (comma-separated); 0, the head as it was, is always measured")
    ap.add_argument("--scale", type=float, default=None,
                    help="write the circuit at this output scale (measured beside --scales) instead of the best one "
                         "on the check shards")
    ap.add_argument("--bigram", action="store_true",
                    help="query and key maps read both halves, and the match is on two tokens: the known one and "
                         "the one before it (the query's target feature carries it, and the key's carries its own "
                         "predecessor), so a token seen before with other continuations is told apart")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    problems = []
    if not (args.head / "config.json").is_file():
        problems.append(f"--head {args.head}: no config.json there; give an EAGLE-3 head's folder")
    if not (args.features / "manifest.json").is_file():
        problems.append(f"--features {args.features}: no manifest.json there; give a folder of "
                        "scripts/target_features.py")
    if args.out.resolve() == args.head.resolve():
        problems.append(f"--out {args.out} is the --head folder; write the extended head elsewhere")
    if args.window is not None and args.window < 2:
        problems.append(f"--window {args.window}: give at least 2 rows")
    if args.epochs < 0:
        problems.append(f"--epochs {args.epochs}: give 0 or more")
    if not (math.isfinite(args.lr) and args.lr > 0):
        problems.append(f"--lr {args.lr}: give a positive rate")
    if args.check < 1:
        problems.append(f"--check {args.check}: give at least 1 held-out shard")
    if args.scale is not None and not (math.isfinite(args.scale) and args.scale >= 0):
        problems.append(f"--scale {args.scale}: give 0 or a positive number")
    if args.threads < 1:
        problems.append(f"--threads {args.threads}: give at least 1")
    if not problems:  # what the folders hold, read before any model loads
        try:
            problems += folder_problems(args)
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as e:
            problems.append(f"--head {args.head} / --features {args.features}: their config.json or manifest.json "
                            f"cannot be read ({type(e).__name__}: {e}); give folders this toolkit wrote")
    if problems:
        raise SystemExit(problems[0])
    return args


def shard_count(folder: Path) -> int:
    return int(json.loads((folder / "manifest.json").read_text())["sequences"])


def folder_problems(args: argparse.Namespace) -> list[str]:
    """Options that only the head's config and the shard manifests can refute."""
    problems = []
    config = json.loads((args.head / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if not 1 <= args.pairs <= head_dim // 2:
        problems.append(f"--pairs {args.pairs}: give 1 to head_dim / 2 = {head_dim // 2}")
    count = shard_count(args.features)
    if args.check_features is None:
        if args.check >= count:
            problems.append(f"--check {args.check}: the features hold {count} shards; keep some to fit on")
    elif not (args.check_features / "manifest.json").is_file():
        problems.append(f"--check-features {args.check_features}: no manifest.json there; give a folder of "
                        "scripts/target_features.py")
    elif args.check_features.resolve() == args.features.resolve():
        problems.append(f"--check-features {args.check_features} is the --features folder; give held-out shards, "
                        "or leave it out to keep the last --check shards of --features")
    elif args.check > (held := shard_count(args.check_features)):
        problems.append(f"--check {args.check}: --check-features holds {held} shards; ask for at most that many")
    return problems


@torch.no_grad()
def halves(head, shard: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding half, hidden half) of every head row of one shard: row t holds token t + 1 and the
    target's feature at position t, as the attention's input sees them."""
    mid = head.midlayer
    emb = mid.input_layernorm(head.embed_tokens(shard["tokens"][1:]).float())
    hid = mid.hidden_norm(head.fc(head.combine(shard["features"][:-1].float())))
    return emb, hid


def masks(tokens: torch.Tensor, window: int, bigram: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(same, visible) over head rows: key row i holds token i, query row t knows token t + 1; with
    ``bigram`` the tokens before them (i - 1 and t) must match too."""
    rows = len(tokens) - 1
    idx = torch.arange(rows)
    back = idx[:, None] - idx[None, :]
    visible = (back >= 0) & (back < window)
    same = tokens[1:, None] == tokens[None, :-1]
    if bigram:
        before = torch.zeros_like(same)
        before[:, 1:] = tokens[:-1, None] == tokens[None, :-2]
        same &= before
    return same, visible


@torch.no_grad()
def agreement(head, shards: list[dict], target_out: torch.Tensor, window: int) -> dict:
    """First drafting step, teacher-forced: the head's token against the target's greedy one, on copied
    rows (recall sequences' second copies) and on the others."""
    hits = {"copied": [0, 0], "other": [0, 0]}
    for shard in shards:
        tokens = shard["tokens"]
        out = head(tokens[1:].unsqueeze(0), shard["features"][:-1].float().unsqueeze(0), window=window)
        drafted = head.draft_to_target(out.logits[0].argmax(-1))[:-1]  # row t drafts token t + 2
        greedy = (shard["final"][1:-1].float() @ target_out.T).argmax(-1)
        ok = drafted == greedy
        copied = shard["copied"][2:]
        for name, rows in (("copied", copied), ("other", ~copied)):
            hits[name][0] += int(ok[rows].sum())
            hits[name][1] += int(rows.sum())
    total = sum(h for h, _ in hits.values()), sum(n for _, n in hits.values())
    return {name: round(h / max(n, 1), 4) for name, (h, n) in {**hits, "all": total}.items()}


def ridge(inputs: torch.Tensor, targets: torch.Tensor, strength: float = 1e-4) -> tuple[torch.Tensor, float]:
    """A ridge regression of ``targets`` (N, c) on ``inputs`` (N, m), the penalty ``strength`` times the
    inputs' summed mean square: the map (c, m), in float32, and the share of the targets' variance it
    explains (how much of the token code a linear key map can read from those inputs)."""
    x, y = inputs.double(), targets.double()
    gram = x.T @ x
    penalty = strength * gram.trace() / x.shape[1]
    weights = torch.linalg.solve(gram + penalty * torch.eye(x.shape[1], dtype=torch.float64), x.T @ y)
    explained = float(1 - ((y - x @ weights) ** 2).sum() / ((y - y.mean(0)) ** 2).sum())
    return weights.T.float(), explained


def read_back_output(head, value: torch.Tensor, fit: list[dict]) -> torch.Tensor:
    """The output map (H, D), fitted so that the head's ``norm`` and ``lm_head`` read a token's value back as
    that token (cross-entropy over the draft tokens that occur in the fitting shards, weighted by their
    frequency there)."""
    c = head.config
    draft_ids = head.draft_to_target(torch.arange(c.draft_vocab_size))
    counts = torch.bincount(torch.cat([s["tokens"] for s in fit]), minlength=c.vocab_size).float()[draft_ids]
    seen = counts.nonzero().squeeze(1)  # the rows: draft tokens that occur (a token never seen weighs nothing)
    weights = counts[seen] / counts.sum()
    with torch.no_grad():
        carried = head.midlayer.input_layernorm(head.embed_tokens(draft_ids[seen]).float()) @ value.T  # (seen, D)
    output = value.T.clone().requires_grad_(True)  # (H, D)
    fitter = torch.optim.Adam([output], lr=3e-2)
    for _ in range(300):
        logits = head.lm_head((carried @ output.T) * head.norm.weight)
        readback = (torch.nn.functional.cross_entropy(logits, seen, reduction="none") * weights).sum()
        fitter.zero_grad()
        readback.backward()
        fitter.step()
    log(f"output map: read-back loss {readback.item():.4f} (frequency-weighted over the draft tokens that occur)")
    return output.detach()


def saved_progress(args: argparse.Namespace) -> tuple[Path, dict, dict | None]:
    """The progress folder, the settings a resumed fit must share, and the progress saved there (None when
    there is none); progress of other settings is refused in one line, before any model loads."""
    work = args.work or ROOT / ".cache" / f"induction-{args.out.name}"
    settings = {k: str(v) for k, v in vars(args).items() if k not in ("out", "work", "threads", "epochs", "scales", "scale")}
    progress_file = work / "progress.pt"
    if not progress_file.is_file():
        return work, settings, None
    saved = torch.load(progress_file, weights_only=False)
    if saved["settings"] != settings:
        raise SystemExit(f"{work} holds progress of other settings; remove it or give another --work "
                         "(--epochs and --scales may change: a rerun with more epochs continues)")
    return work, settings, saved


def main() -> None:
    args = parse()
    work, settings, saved = saved_progress(args)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # tiny softmax gradients would otherwise turn into subnormal numbers, which slow a CPU tenfold
    torch.manual_seed(0)
    from ..smollm2 import load_smollm2

    target, _ = load_smollm2()
    try:
        head = load_eagle3_head(args.head, target).float().eval()
    except UserError as e:
        raise SystemExit(str(e)) from None
    for p in head.parameters():
        p.requires_grad_(False)
    c = head.config
    window = args.window or c.max_position_embeddings
    manifest = json.loads((args.features / "manifest.json").read_text())

    def load(folder: Path, indices) -> list[dict]:
        out = [torch.load(folder / f"seq-{i:05d}.pt", weights_only=True) for i in indices]
        for shard in out:
            shard.setdefault("copied", torch.zeros(len(shard["tokens"]), dtype=torch.bool))
        return out

    count = manifest["sequences"]
    if args.check_features is None:
        shards = load(args.features, range(count))
        fit, check = shards[:-args.check], shards[-args.check:]
    else:
        fit, check = load(args.features, range(count)), load(args.check_features, range(args.check))
        shards = fit + check
    log(f"{len(fit)} shards to fit on, {len(check)} to check; window {window}, {args.pairs} RoPE pairs")

    # 1-2: codes and the ridge key map
    rows = [halves(head, s) for s in fit]
    emb = torch.cat([e for e, _ in rows])
    hid = torch.cat([h for _, h in rows])
    moment = emb.T @ emb / len(emb)
    eigenvalues, directions = torch.linalg.eigh(moment.double())
    eigenvalues, directions = eigenvalues.flip(0).float(), directions.flip(1).float()
    width = 2 * args.pairs
    codes = (directions[:, :width] / eigenvalues[:width].sqrt()).T  # (2P, H) whitened
    with torch.no_grad():  # row i's own token, i, which the target feature at position i carries
        own_codes = torch.cat([head.midlayer.input_layernorm(head.embed_tokens(s["tokens"][:-1]).float())
                               for s in fit]) @ codes.T
    key_map, explained = ridge(hid, own_codes)
    log(f"key map from the target feature: R^2 {explained:.3f} over {len(hid):,} rows")
    _, before_fc = ridge(torch.cat([head.combine(s["features"][:-1].float()) for s in fit]), own_codes)
    log(f"the same fit from the target's features before the head's fc: R^2 {before_fc:.3f}")
    del emb, hid, own_codes

    # 3: query and key maps refined on the match itself
    inv_freq, _ = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
    freqs = inv_freq[c.head_dim // 2 - args.pairs:]
    query = (4.0 * codes).clone()  # 4: a match worth a logit of about 4 * 2P / sqrt(d)
    key = key_map.clone()
    if args.bigram:  # both maps read both halves, starting from the one-token match
        query = torch.cat((query, torch.zeros_like(query)), dim=1)
        key = torch.cat((torch.zeros_like(key), key), dim=1)
    query.requires_grad_(True), key.requires_grad_(True)
    optimiser = torch.optim.Adam([query, key], lr=args.lr)
    work.mkdir(parents=True, exist_ok=True)
    progress_file, done, history = work / "progress.pt", 0, []
    if saved is not None:
        query.data.copy_(saved["query"]), key.data.copy_(saved["key"])
        optimiser.load_state_dict(saved["optimiser"])
        done, history = saved["epochs"], saved["history"]
        log(f"resuming after epoch {done}")
    masks_of = [masks(s["tokens"], window, args.bigram) for s in shards]
    rows += [halves(head, s) for s in check]  # the check shards' rows, once, for every epoch's check loss
    scaling = c.head_dim ** -0.5

    def loss_of(index: int) -> torch.Tensor:
        e, h = rows[index]
        positions = torch.arange(len(e))
        same, visible = masks_of[index]
        if args.bigram:
            e = h = torch.cat((e, h), dim=-1)
        return match_loss(rotate_codes(e @ query.T, freqs, positions), rotate_codes(h @ key.T, freqs, positions),
                          same, visible, scaling)

    for epoch in range(done, args.epochs):
        start, total = time.time(), 0.0
        for i in torch.randperm(len(fit)).tolist():
            loss = loss_of(i)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            total += loss.item()
        with torch.no_grad():
            held = sum(loss_of(len(fit) + j).item() for j in range(len(check))) / len(check)
        history.append({"epoch": epoch + 1, "fit_mass": round(math.exp(-total / len(fit)), 4),
                        "check_mass": round(math.exp(-held), 4), "seconds": round(time.time() - start, 1)})
        log(f"epoch {epoch + 1}/{args.epochs}: attention mass on the known token's rows {history[-1]['fit_mass']:.3f} "
            f"(fit), {history[-1]['check_mass']:.3f} (check)")
        atomic_save({"settings": settings, "query": query.detach(), "key": key.detach(),
                     "optimiser": optimiser.state_dict(), "epochs": epoch + 1, "history": history}, progress_file)

    # 4: value and output
    value = directions[:, :c.head_dim].T.contiguous()  # (D, H)
    output = read_back_output(head, value, fit)

    # 5: the scale, on the held-out shards
    target_out = target.get_output_embeddings().weight.detach().float()
    results = {}
    for scale in sorted({0.0, *args.scales, *([args.scale] if args.scale is not None else [])}):
        grown = with_copy_group(head, query.detach(), key.detach(), value, scale * output).eval()
        results[scale] = agreement(grown, check, target_out, window)
        log(f"scale {scale:g}: agreement {results[scale]}")
    best = max(results, key=lambda s: results[s]["all"]) if args.scale is None else args.scale
    grown = with_copy_group(head, query.detach(), key.detach(), value, best * output)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_text(args.out / "config.json", json.dumps(grown.config.to_dict(), indent=2) + "\n")
    state = {k: (v.half() if v.is_floating_point() else v).contiguous()
             for k, v in grown.state_dict().items() if not k.startswith("embed_tokens")}
    atomic_weights(state, args.out / "model.safetensors")
    record = {"command": "python scripts/induction_head.py " + " ".join(
                  f"--{k} {v}" for k, v in {**settings, "epochs": args.epochs}.items()) + f" --out {args.out.name}",
              "from": str(args.head.name), "features": manifest.get("per_source"), "window": window,
              "pairs": args.pairs, "bigram": args.bigram, "key_map_r2": round(float(explained), 4),
              "key_map_r2_before_fc": round(before_fc, 4), "epochs": history,
              "check_shards": args.check,
              "check_features": None if args.check_features is None else args.check_features.name,
              "agreement_by_scale": {f"{s:g}": r for s, r in results.items()},
              "scale": best, "scale_chosen_by": "check shards" if args.scale is None else "--scale", "torch": torch.__version__}
    source_log = args.head / "training_log.json"
    if source_log.is_file():
        record["head"] = json.loads(source_log.read_text())
    atomic_text(args.out / "training_log.json", json.dumps(record, indent=1) + "\n")
    log(f"wrote {args.out} (scale {best:g})")


if __name__ == "__main__":
    main()
