"""``sharpdraft bench``: real speculative decoding through a long generation, watched by output position.

For each prompt of a workload (chat template applied), the target prefills once; then target-only
decoding and every arm (``none``, ``spec``, ``window``, a distance fix, ``lookup``, ...; the
variants of ``sharpdraft eval``) decode up to ``new_tokens`` tokens from copies of that prefill,
stopping early where the target writes its end-of-sequence token (``min_new_tokens`` bars that token
until so many are written, as ``sharpdraft generate`` does: a target that answers in a few hundred
tokens then writes on, which is how a short-answer workload becomes a long generation). Each run keeps
its list of accepted drafts per verification, its decode time and its text, so the report gives per arm
(:mod:`calibrate.measure.longgen`): acceptance length per bin of output position with a 95% interval
over prompts, the fade (last bin over first), tokens/s, the speedup over target-only per prompt and
its geometric mean over prompts (the paper's headline figure), how many outputs ended in a loop, and
what the text does per bin (3-gram lookup share, distinct 4-grams), so a fade can be told from a loop.

Greedy (the default): every arm's output must equal target-only decoding; the result says so per
arm. Sampled (``temperature`` > 0): speculative sampling keeps the target's law, not its sample, so
each arm writes its own text; runs from one prompt share a random stream (paired seeds), and arms
are compared on a fixed text by ``sharpdraft eval`` on a generated corpus instead.

Progress is saved per prompt (``OUT.partial/``, atomic files); ``--resume`` continues a run with
the same options.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from sharpdraft_theory import ScaleSpec
from sharpdraft_theory.atomic import atomic_path, atomic_write_text

from .bench_tables import same_as_target
from .drafters import default_drafter_path
from .errors import UserError
from .measure import SavedUnits, partial_dir
from .measure.longgen import acceptance_by_bin, fade, geometric_mean, looped, prompts_by_bin, text_by_bin
from .online import ONLINE_VARIANTS, OnlineOptions, check_rank_unloaded, online_arms, online_options
from .preflight import check_outputs, local_inputs
from .workloads import Workload, chat_ids, check_fits, load_workload, parse_workload

__all__ = ["BenchOptions", "run_bench", "report_tables"]

MAX_NEW_TOKENS = 1 << 17
DEFAULT_VARIANTS = ("none", "spec", "window")


@dataclass(frozen=True)
class BenchOptions:
    """Every option of a bench run; :meth:`check` validates them once, before any model loads."""

    out: Path
    drafter: str = "eagle3"
    drafter_path: str | None = None
    pointer_unmatched: str | None = None  # the copy pointer's rows matching nothing: scored or masked; None: its file's
    target_path: str | None = None
    spec: Path | None = None
    workload: str = "diary"
    prompts: int = 2
    new_tokens: int = 2048
    min_new_tokens: int = 0  # the end-of-sequence token is barred until this many tokens are written
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    window: int | None = None
    num_draft: int | None = None
    bin_size: int = 512
    temperature: float = 0.0
    seed: int = 0
    threads: int | None = None  # CPU threads for torch (None: torch's default)
    plot: Path | None = None  # a PNG of acceptance against output position (drawn by the command)
    resume: bool = False
    online_every: int | None = None  # online arms: period T, rows learnt from per update (None: calibrate.online's)
    online_steps: int | None = None  # AdamW steps per update
    online_lr: float | None = None  # AdamW learning rate
    online_rank: int | None = None  # online-lora's rank r

    def check(self) -> Workload:
        """The prompts to decode; ``UserError`` naming the first bad option."""
        from .drafters import drafter_kind
        from .drafters.pointer import check_unmatched
        from .eval.variants import check_variants

        drafter_kind(self.drafter, evaluates=True)
        check_unmatched(self.pointer_unmatched, default_drafter_path(self.drafter, self.drafter_path))
        if not 1 <= self.new_tokens <= MAX_NEW_TOKENS:
            raise UserError(f"--new-tokens {self.new_tokens}: expected 1 to {MAX_NEW_TOKENS}")
        if not 0 <= self.min_new_tokens <= self.new_tokens:
            raise UserError(f"--min-new-tokens {self.min_new_tokens}: expected 0 to --new-tokens ({self.new_tokens})")
        if not 1 <= self.bin_size <= self.new_tokens:
            raise UserError(f"--bin-size {self.bin_size}: expected 1 to --new-tokens ({self.new_tokens})")
        if not 1 <= self.prompts <= 10_000:
            raise UserError(f"--prompts {self.prompts}: expected at least 1")
        if self.num_draft is not None and not 1 <= self.num_draft <= 64:
            raise UserError(f"--num-draft {self.num_draft}: expected 1 to 64 drafts a verification")
        if not (math.isfinite(self.temperature) and (self.temperature == 0 or 0.01 <= self.temperature <= 100)):
            raise UserError(f"--temperature {self.temperature}: expected 0 (greedy) or 0.01 to 100")
        if not 0 <= self.seed < 2**63:
            raise UserError(f"--seed {self.seed}: expected 0 to 2^63 - 1")
        if self.threads is not None and self.threads < 1:
            raise UserError(f"--threads {self.threads}: expected at least 1 (or leave it out for torch's default)")
        check_variants(list(self.variants), window=self.window, sinks=4, has_reference=False)
        online = self.online()
        if online is not None and any(v.startswith("online-lora") for v in self.variants):
            check_rank_unloaded(self.drafter, self.drafter_path, online.rank)  # the widths, from its config alone
        if "spec" in self.variants and self.spec is None:
            raise UserError("--variants spec: pass --spec with the spec to check (sharpdraft calibrate --out), or "
                            "leave spec out of --variants")
        if self.spec is not None and not self.spec.is_file():
            raise UserError(f"--spec {self.spec}: no such file; write one with `sharpdraft calibrate --out`")
        if self.plot is not None and self.plot.suffix.lower() != ".png":
            raise UserError(f"--plot {self.plot}: expected a .png file")
        check_outputs({"--out": self.out, "--plot": self.plot},
                      local_inputs(spec=self.spec, workload=parse_workload(self.workload)[0],
                                   drafter_path=self.drafter_path, target_path=self.target_path))
        SavedUnits(partial_dir(self.out), self.to_dict(), self.resume)  # an interrupted run: --resume, same options
        workload = load_workload(self.workload, default_split="heldout")
        if self.prompts > len(workload.prompts):
            raise UserError(f"--prompts {self.prompts}: {workload.name}:{workload.split} has {len(workload.prompts)}")
        return Workload(workload.name, workload.path, workload.split, workload.prompts[:self.prompts])

    def online(self) -> OnlineOptions | None:
        """How the online arms learn (``calibrate.online.online_options``: a bad value refused in one line),
        None without an online arm."""
        return online_options(self.variants, kind=self.drafter, every=self.online_every, steps=self.online_steps,
                              lr=self.online_lr, rank=self.online_rank, resume=self.resume, decoding=True)

    def to_dict(self) -> dict:
        """The options a resumed run must match (the resume key); ``online`` only with an online arm."""
        d = asdict(self)
        for name in ("out", "resume", "threads", "plot", "online_every", "online_steps", "online_lr", "online_rank"):
            d.pop(name)
        d["spec"] = None if self.spec is None else str(self.spec)
        d["drafter_path"] = default_drafter_path(self.drafter, self.drafter_path)  # the drafter as loaded
        d["variants"] = list(self.variants)
        for name in ("min_new_tokens", "pointer_unmatched"):
            if not d[name]:
                d.pop(name)  # the key of runs saved before the option existed
        online = self.online()
        if online is not None:
            d["online"] = online.to_dict()
        return d


def _unit(value, variants) -> dict:
    """A saved prompt (``_one_prompt``'s value) checked against the run's arms: a ``ValueError`` otherwise."""
    arms = value.get("arms") if isinstance(value, dict) else None
    runs = [value["target"], *(arms.get(v) for v in variants)] if isinstance(arms, dict) and "target" in value else []
    if not runs or not isinstance(value.get("prompt_tokens"), int) or not all(
            isinstance(r, dict) and isinstance(r.get("accepted"), list) and isinstance(r.get("tokens"), int)
            and isinstance(r.get("decode_seconds"), (int, float)) and isinstance(r.get("text"), dict) for r in runs):
        raise ValueError("expected prompt_tokens, and target and every arm's accepted, tokens, decode_seconds, text")
    return value


def run_bench(opts: BenchOptions, *, drafter=None, progress=None) -> dict:
    """Decode every prompt target-only and by every arm; the JSON-ready result (see the module docstring).

    ``drafter``: an adapter already loaded (tests); default: ``opts``' kind and paths on the CPU.
    ``progress(message)`` is called before each prompt.
    """
    import torch

    from .drafters import load_drafter
    from .eval.run import draft_length
    from .eval.variants import default_spec, variant_specs

    workload = opts.check()
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    spec = None if opts.spec is None else ScaleSpec.load(opts.spec)
    if drafter is None:
        drafter = load_drafter(opts.drafter, opts.drafter_path, opts.target_path, torch.device("cpu"), torch.float32,
                               pointer_unmatched=opts.pointer_unmatched)
    tokenizer = drafter.tokenizer
    context = int(getattr(drafter.target.config, "max_position_embeddings", 0) or 0)
    if context:
        check_fits(workload, tokenizer, context, opts.new_tokens)
    n_ref = drafter.default_n_ref
    spec = spec or default_spec(n_ref, 4)
    specs = variant_specs(spec, n_ref, [v for v in opts.variants if v not in ONLINE_VARIANTS], window=opts.window)
    specs |= {arm.name: arm.spec for arm in online_arms(opts.variants, spec)}  # +spec: the spec under test
    arms = {name: specs[name] for name in opts.variants}
    num_draft = draft_length(drafter, opts.num_draft)
    saved = SavedUnits(partial_dir(opts.out), opts.to_dict(), opts.resume)
    units = []
    for i, prompt in enumerate(workload.prompts):
        key = f"{i:05d}-{prompt.id}"
        unit = saved.get(key, lambda value: _unit(value, opts.variants))
        if unit is None:
            if progress:
                progress(f"{prompt.id} ({i + 1}/{len(workload.prompts)})")
            unit = _one_prompt(drafter, arms, chat_ids(tokenizer, prompt), opts, num_draft, opts.online())
            saved.put(key, unit)
        units.append(unit)
    result = _result(opts, workload, units, num_draft, drafter)
    atomic_write_text(opts.out, json.dumps(result, indent=1))
    saved.finish()
    return result


def _one_prompt(drafter, arms: dict, prompt_ids: list[int], opts: BenchOptions, num_draft: int,
                online: OnlineOptions | None) -> dict:
    """Target-only and every arm from one shared prefill: accepted lists, times, texts' statistics, the
    peak memory of each decode and an online arm's updates and extra state."""
    import torch

    from .eval.decode import prompt_seed
    from .online import PeakMemory
    from .speculative import GREEDY, Sampling, prefill

    prompt = torch.tensor([prompt_ids], device=drafter.device)

    def rule():
        return GREEDY if opts.temperature == 0 else Sampling(opts.temperature, prompt_seed(opts.seed, prompt))

    eos = drafter.eos_token_id
    shared = prefill(drafter.target, prompt, drafter.feature_ids)

    def run(spec, name):
        proposer = arm_proposer(drafter, spec, name, eos, online, num_draft)
        with PeakMemory(drafter.device) as peak:
            out = decode(drafter, proposer, prompt, opts.new_tokens, num_draft, shared, rule(), eos,
                         opts.min_new_tokens)
        return out, _run(out, opts) | _cost(proposer, peak)

    base, unit_target = run(None, None)
    unit = {"prompt_tokens": len(prompt_ids), "target": unit_target, "arms": {}}
    for name, spec in arms.items():
        out, unit["arms"][name] = run(spec, name)
        unit["arms"][name]["identical"] = out.tokens == base.tokens
    return unit


def arm_proposer(drafter, spec, arm: str | None, eos, online: OnlineOptions | None = None, num_draft: int = 4):
    """The proposer of one arm: target-only when ``arm`` is None, else the adapter's proposer under ``spec``
    (``lookup``: prompt lookup alone; ``lookup+head``: lookup before the proposer; an online arm: that proposer
    learning as it drafts, ``calibrate.online.OnlineProposer``, from the checkpoint each time; a PARD drafter
    learns the ``num_draft`` rows it drafts a forward)."""
    from .eval.variants import LOOKUP_VARIANTS
    from .lookup import LookupProposer, LookupSettings
    from .online import online_proposer
    from .speculative import NoProposer

    if arm is None:
        return NoProposer()
    if arm in ONLINE_VARIANTS:
        return online_proposer(drafter, arm.removesuffix("+spec"), spec, online, num_draft)
    proposer = drafter.proposer(spec) if arm != "lookup" else None
    if arm in LOOKUP_VARIANTS:
        vocab = drafter.target.get_output_embeddings().weight.shape[0]
        proposer = LookupProposer(vocab, LookupSettings(eos_token_id=eos), proposer)
    return proposer


def decode(drafter, proposer, prompt, new_tokens: int, num_draft: int, shared, rule, eos, min_new_tokens: int = 0):
    """One decode of ``proposer`` (:func:`arm_proposer`) through the one loop, from the ``shared`` prefill,
    stopping after ``eos`` (barred before ``min_new_tokens``); the proposer is closed after it."""
    from .speculative import speculative_generate

    try:
        return speculative_generate(drafter.target, proposer, prompt, new_tokens, num_draft, shared, rule, stop=eos,
                                    min_new_tokens=min_new_tokens)
    finally:
        proposer.close()


def _run(out, opts: BenchOptions) -> dict:
    """What a prompt's run keeps: accepted drafts per verification, decode time, the text's own statistics."""
    bins = -(-opts.new_tokens // opts.bin_size)
    text = text_by_bin(out.tokens, opts.bin_size, bins)
    return {"accepted": list(out.accepted), "tokens": len(out.tokens), "decode_seconds": out.decode_seconds,
            "decode_tokens": out.decode_tokens, "draft_seconds": out.draft_seconds, "looped": looped(out.tokens),
            "text": {k: [None if math.isnan(x) else round(float(x), 4) for x in v] for k, v in text.items()}}


def _cost(proposer, peak) -> dict:
    """What a run cost beyond its time: the decode's peak memory (``calibrate.online.PeakMemory``), and for an
    online arm its updates' wall time (inside ``decode_seconds``), their count and its extra state in bytes."""
    from .online import extra_bytes, learning

    online = learning(proposer)  # the learner, also inside a copy pointer
    return {"peak_memory": peak.peak, "peak_memory_method": peak.method,
            "update_seconds": online.update_seconds if online else 0.0,
            "updates": online.updates if online else 0,
            "extra_bytes": online.extra_bytes() if online else extra_bytes(None) | {"buffer": 0}}


def _r(x, digits: int = 4):
    return None if x is None else round(float(x), digits)


def _triple(t):
    return None if t is None else [_r(v) for v in t]


def _result(opts: BenchOptions, workload: Workload, units: list[dict], num_draft: int, drafter) -> dict:
    from .eval.run import pointer_record

    bins = -(-opts.new_tokens // opts.bin_size)
    full = [i for i, u in enumerate(units) if u["target"]["tokens"] >= opts.new_tokens]
    arms = {}
    for name in opts.variants:
        runs = [u["arms"][name] for u in units]
        accepted = [r["accepted"] for r in runs]
        speedups = [(u["target"]["decode_seconds"] / max(u["target"]["decode_tokens"], 1))
                    / (r["decode_seconds"] / max(r["decode_tokens"], 1)) for u, r in zip(units, runs)]
        text = {k: [_r(np.nanmean([np.nan if r["text"][k][b] is None else r["text"][k][b] for r in runs]))
                    if any(r["text"][k][b] is not None for r in runs) else None for b in range(bins)]
                for k in runs[0]["text"]}
        seconds = sum(r["decode_seconds"] for r in runs)
        arms[name] = {
            "acceptance_by_bin": [_triple(t) for t in acceptance_by_bin(accepted, opts.bin_size, bins)],
            "prompts_by_bin": prompts_by_bin(accepted, opts.bin_size, bins),
            "acceptance_length": _r(sum(len(a) + sum(a) for a in accepted) / max(sum(len(a) for a in accepted), 1)),
            "fade": _triple(fade([accepted[i] for i in full], opts.bin_size)) if full else None,
            "fade_prompts": len(full),
            "tokens_per_second": _r(sum(r["decode_tokens"] for r in runs) / seconds if seconds else None, 2),
            "speedup_per_prompt": [_r(s) for s in speedups],
            "speedup_geomean": _triple(geometric_mean(speedups)),
            "looped": sum(r["looped"] is not None for r in runs),
            "identical": None if opts.temperature else all(r["identical"] for r in runs),
            "text_by_bin": text,
            **_arm_cost(runs, [u["arms"].get("none") for u in units]),
        }
    target_seconds = sum(u["target"]["decode_seconds"] for u in units)
    return {
        "schema": "sharpdraft.bench/v1",
        "options": opts.to_dict(),
        "workload": workload.to_dict(),
        "drafter": {"kind": opts.drafter, "path": drafter.info.path, "n_ref": drafter.default_n_ref,
                    **pointer_record(drafter)},
        "num_draft": num_draft,
        "bins": [[b * opts.bin_size, min((b + 1) * opts.bin_size, opts.new_tokens)] for b in range(bins)],
        "prompts": [{"id": p.id, "prompt_tokens": u["prompt_tokens"], "output_tokens": u["target"]["tokens"],
                     "target_looped": u["target"]["looped"]} for p, u in zip(workload.prompts, units)],
        "target": {"tokens_per_second": _r(sum(u["target"]["decode_tokens"] for u in units) / target_seconds
                                           if target_seconds else None, 2)},
        "arms": arms,
        "units": units,
    }


def _arm_cost(runs: list[dict], frozen: list[dict | None]) -> dict:
    """An arm's cost over the prompts: update seconds (summed; inside ``decode_seconds``) and their share of it,
    updates, the largest peak memory and extra state of any prompt, and the peak over the ``none`` arm's (the
    frozen drafter's) of the same prompt, its largest, where both were measured."""
    peaks = [r.get("peak_memory") for r in runs]
    over = [r.get("peak_memory") - f.get("peak_memory") for r, f in zip(runs, frozen)
            if f is not None and r.get("peak_memory") is not None and f.get("peak_memory") is not None]
    held = [r["extra_bytes"] for r in runs if r.get("extra_bytes")]
    seconds = sum(r["decode_seconds"] for r in runs)
    updates = sum(r.get("update_seconds", 0.0) for r in runs)
    return {"update_seconds": _r(updates), "update_share": _r(updates / seconds if seconds else None),
            "updates": sum(r.get("updates", 0) for r in runs),
            "peak_memory": max(peaks) if None not in peaks else None,
            "peak_memory_over_none": max(over) if over else None,
            "extra_bytes": max(held, key=lambda h: h["total"]) if held else None}


def report_tables(result: dict):
    """Rich tables of a bench result: acceptance length per output bin per arm, then speed and the fade."""
    from rich.table import Table

    def cell(t):
        if t is None:
            return "-"
        return f"{t[0]:.2f}" + ("" if t[1] is None else f" [{t[1]:.2f}, {t[2]:.2f}]")

    by_bin = Table(title=f"acceptance length by output position ({len(result['prompts'])} prompts, "
                         f"95% interval over prompts)")
    by_bin.add_column("arm")
    for lo, hi in result["bins"]:
        by_bin.add_column(f"{lo}-{hi}", justify="right")
    for name, arm in result["arms"].items():
        by_bin.add_row(name, *[cell(t) for t in arm["acceptance_by_bin"]])
    speed = Table(title=f"speed (target only: {result['target']['tokens_per_second']} tokens/s)")
    learning = any(arm.get("updates") for arm in result["arms"].values())  # the online arms' columns, with one
    speed.caption = ("fade: last bin over first; speedup: geometric mean over prompts; peak: the largest of any "
                     "prompt's decode; " + ("updates: seconds learning, inside the decode time; extra: state beyond "
                                            "the drafter; " if learning else "") + "= target: greedy output equal")
    columns = ("arm", "accept.", "fade", "tokens/s", "speedup", *(("updates s",) if learning else ()), "peak MiB",
               *(("extra MiB",) if learning else ()), "looped", "= target")
    for col in columns:
        speed.add_column(col, justify="right")

    def mib(n):
        return "-" if n is None else f"{n / 2**20:.0f}"

    for name, arm in result["arms"].items():
        fade_cell = "-" if arm["fade"] is None else f"{cell(arm['fade'])} (n={arm['fade_prompts']})"
        extra = arm.get("extra_bytes")
        updates = (f"{arm.get('update_seconds') or 0:.1f}",) if learning else ()
        held = (mib(extra and extra["total"]),) if learning else ()
        speed.add_row(name, f"{arm['acceptance_length']:.2f}", fade_cell, str(arm["tokens_per_second"]),
                      cell(arm["speedup_geomean"]), *updates, mib(arm.get("peak_memory")), *held,
                      f"{arm['looped']}/{len(result['prompts'])}",
                      same_as_target(arm))
    return by_bin, speed


def plot_result(result: dict, path: Path) -> None:
    """Acceptance length against output position per arm (bin centres; bars: 95% interval over prompts)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    centres = [(lo + hi) / 2 for lo, hi in result["bins"]]
    for name, arm in result["arms"].items():
        pts = [(x, t) for x, t in zip(centres, arm["acceptance_by_bin"]) if t is not None]
        if not pts:
            continue
        xs, ts = zip(*pts)
        ys = [t[0] for t in ts]
        err = [[y - (t[1] if t[1] is not None else y) for y, t in zip(ys, ts)],
               [(t[2] if t[2] is not None else y) - y for y, t in zip(ys, ts)]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name)
    ax.set_xlabel("output position (tokens generated)")
    ax.set_ylabel("acceptance length (tokens per target forward)")
    ax.set_title(f"{result['workload']['name']}: {result['drafter']['kind']}, {len(result['prompts'])} prompts")
    ax.legend()
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
