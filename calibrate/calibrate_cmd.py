"""``sharpdraft calibrate``: a thin typer command over ``calibrate.run.run_calibration``."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sharpdraft_theory.estimators import ESTIMATOR_CHOICES, get_estimator

from .drafters import DEFAULT_DRAFTERS, kind_names
from .errors import UserError
from .numbers import fixed

__all__ = ["calibrate", "print_fit"]

console = Console()


def calibrate(
    *,
    out: Annotated[Path, typer.Option("--out", help="Where to write the scale spec (JSON).")],
    drafter: Annotated[str, typer.Option(help=f"Drafter kind: {', '.join(kind_names())}.")] = "hf",
    drafter_path: Annotated[Optional[str], typer.Option(
        "--drafter-path", help="Drafter checkpoint folder, .gguf file or hub id (default: SmolLM2 for hf; "
                               f"{DEFAULT_DRAFTERS}).")] = None,
    target_path: Annotated[Optional[str], typer.Option(
        "--target-path", help="Target model folder (eagle3, dflash; the tokenizer source for hf/pard without one).")] = None,
    corpus: Annotated[str, typer.Option(
        help="pydoc[:train|heldout|all], a .txt or .jsonl file, a folder, or generated:NAME[:SPLIT] (the target's "
             "own text: diary, math, science, NAME-greedy, or a `sharpdraft generate` folder).")] = "pydoc",
    max_length: Annotated[Optional[int], typer.Option("--max-length", help="Tokens per sequence (default 4 x n_ref).")] = None,
    sequences: Annotated[int, typer.Option(help="Sequences to read from the corpus.")] = 8,
    n_ref: Annotated[Optional[int], typer.Option("--n-ref", help="Reference length: the drafter's training context "
                                                  "(default: from the drafter).")] = None,
    top_k: Annotated[int, typer.Option("--top-k", help="Size of the top set whose mass the slope restores.")] = 4,
    granularity: Annotated[str, typer.Option(help="Slope per global, layer or head.")] = "global",
    estimator: Annotated[str, typer.Option(help=f"Slope written to the spec: {ESTIMATOR_CHOICES} (name or label).")]
        = "mass-matching",
    alpha_max: Annotated[Optional[float], typer.Option("--alpha-max", help="Cap on alpha written to the spec (default: "
                                                       "none; the summary warns when alpha(16 n_ref) passes 4).")]
        = None,
    law: Annotated[str, typer.Option(help="log-linear (one fitted slope) or tabulated (mass matching's alpha per "
                                          "length bucket, extrapolated past the calibrated lengths).")] = "log-linear",
    max_n: Annotated[Optional[int], typer.Option("--max-n", help="tabulated: extrapolate knots up to this length "
                                                 "(default 64 x n_ref); alpha holds past it.")] = None,
    device: Annotated[str, typer.Option(help="auto (CUDA when present), cpu or cuda.")] = "auto",
    dtype: Annotated[str, typer.Option(help="Weights: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16.")]
        = "auto",
    chunk: Annotated[Optional[int], typer.Option(help="Query rows per chunk of the logit reduction "
                                                 "(default: a 2 MiB logit budget); lower it on CUDA out of memory.")] = None,
    stats: Annotated[Optional[Path], typer.Option(help="Also save the per-row statistics here (.npz).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue an interrupted run with the same options.")] = False,
    aux_layer_reading: Annotated[Optional[str], typer.Option(
        "--aux-layer-reading", help="How a head's aux layer ids map to target hidden states: vllm (id), sglang "
                                    "(id + 1 when the first id is 1) or sglang-legacy (id + 1) (default: as the "
                                    "config's own layout states).")] = None,
    select: Annotated[bool, typer.Option(
        "--select", help="After the fit, measure the candidate deployments (none, the fitted spec, slopes around "
                         "it, qwen-logn, windows, sinks, distance fixes) teacher-forced on the calibration sequences "
                         "and write the one whose agreement gain past n_ref is largest with an interval above 0 "
                         "(none when no candidate qualifies).")] = False,
):
    """Collect attention-logit statistics from a drafter over a corpus and fit the query-scaling slope.

    Under torchrun, every rank runs its share of the sequences and rank 0 alone prints and writes.
    """
    from .distributed import is_main_process
    from .run import CalibrateOptions, check_options, run_calibration

    try:
        estimator = get_estimator(estimator).name  # a label or alias (E1, closed_form, ...) to the canonical name
    except ValueError as err:
        raise UserError(f"--estimator {estimator}: {err}") from None
    opts = CalibrateOptions(out=out, drafter=drafter, drafter_path=drafter_path, target_path=target_path,
                            corpus=corpus, max_length=max_length, sequences=sequences, n_ref=n_ref, top_k=top_k,
                            granularity=granularity, estimator=estimator, alpha_max=alpha_max, law=law, max_n=max_n,
                            device=device, dtype=dtype, chunk=chunk, stats=stats, resume=resume,
                            aux_layer_reading=aux_layer_reading, select=select)
    check_options(opts)  # a refusal comes before the banner and before any model loads
    main = is_main_process()  # under torchrun the other ranks are quiet
    if main:
        console.print(f"[bold]Calibrating[/] {drafter} drafter ({drafter_path or 'built-in'}) on {corpus}")
    with _RichProgress() if main else contextlib.nullcontext() as progress:
        try:
            result = run_calibration(opts, progress=progress)
        except KeyboardInterrupt:
            if main:
                console.print(f"[yellow]interrupted[/] after {progress.done} of {progress.total} sequences; "
                              "rerun the same command with --resume to continue")
            raise typer.Exit(130) from None
    if not main:
        return
    _summary(result, out)
    if stats is not None:
        console.print(f"Wrote [bold]{stats}[/] (per-row statistics and the run's settings; "
                      f"`sharpdraft plot {stats}` and `sharpdraft fit {stats}` read them)", soft_wrap=True)


class _RichProgress:
    """``calibrate.run.Progress`` as a rich bar: sequences, tokens/s, rows. The bar appears once
    collection starts, so a run refused while loading prints no empty bar."""

    def __init__(self):
        self.bar = Progress(TextColumn("[bold]collecting"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[rate]:>8.0f} tokens/s"), TextColumn("{task.fields[rows]:>9,} rows"),
                            TimeElapsedColumn(), console=console, transient=False)
        self.total = self.done = 0
        self.shown = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc) if self.shown else None

    def start(self, total: int, done: int, tokens_per_sequence: int) -> None:
        self.bar.__enter__()
        self.shown = True
        self.total, self.done = total, done
        self.tokens, self.rows, self.began = 0, 0, time.perf_counter()
        self.task = self.bar.add_task("collect", total=total, completed=done, rate=0.0, rows=0)

    def advance(self, tokens: int, rows: int) -> None:
        self.done += 1
        self.tokens += tokens
        self.rows += rows
        rate = self.tokens / max(time.perf_counter() - self.began, 1e-9)
        self.bar.update(self.task, advance=1, rate=rate, rows=self.rows)


def _summary(result, out: Path) -> None:
    for note in result.notes:
        console.print(f"[yellow]note:[/] {note}")
    rate = f", {result.tokens / result.seconds:,.0f} tokens/s" if result.seconds > 0 else ""
    ranks = f" on {result.world_size} processes" if result.world_size > 1 else ""
    console.print(f"Collected {result.stats.rows:,} rows from {result.spec.calibration.sequences} sequences{ranks} "
                  f"in {result.seconds:.1f} s{rate}" + (f" ({result.resumed} resumed)" if result.resumed else ""))
    print_fit(result.fitted, result.fit, out, chosen=None if result.selection is None else result.selection["chosen"])
    if result.selection is not None:
        print_selection(result.selection, result.seconds)


def print_selection(record: dict, collection_seconds: float | None = None) -> None:
    """The candidates' gains over none past n_ref in the record's metric (and from the best by mean), every
    other gain the record holds, the decision and why, its cost. Only what the spec validator requires is
    indexed (``sharpdraft_theory.spec``: a measured candidate's gains hold the metric); a gain some candidates
    lack shows as -."""
    from .select import decision_line

    metric = record["metric"]
    cells = {name: cell for name, cell in record["candidates"].items() if name != "none"}
    others = list(dict.fromkeys(m for cell in cells.values() for m in cell["gain"] if m != metric))
    within = any("within_n_ref" in cell for cell in cells.values())
    table = Table(title=f"Candidates on the {record['sequences']} calibration sequences: gain over none, "
                        f"mean of n in {record['buckets']}")
    for col in (("candidate", f"{_metric_label(metric)} [95%]", f"minus {record['best'] or 'the best'} [95%]")
                + tuple(f"{_metric_label(m)} [95%]" for m in others)
                + ((f"{metric} at n <= n_ref [95%]",) if within else ())):
        table.add_column(col)
    for name, cell in cells.items():
        style = "bold green" if name == record["chosen"] else None
        short = ((_triple((cell.get("within_n_ref") or {}).get(metric)),) if within else ())
        table.add_row(name, _triple(cell["gain"][metric]), _triple(cell.get("versus_best")),
                      *(_triple(cell["gain"].get(m)) for m in others), *short, style=style)
    console.print(table)
    console.print(f"[bold]{decision_line(record)}[/]")
    console.print(f"Why: {record['reason']}")
    cost = (f" ({record['seconds'] / collection_seconds:.1f} x the collection)"
            if collection_seconds else "")
    console.print(f"Selection: {record['seconds']:.1f} s{cost}; rule: {record['rule']}")


def _metric_label(metric: str) -> str:
    """A metric's column heading: ``expected accept.`` for expected_acceptance, else its name."""
    return {"expected_acceptance": "expected accept."}.get(metric, metric)


def _triple(t) -> str:
    if t is None:
        return "-"
    return f"{t[0]:+.4f}" + ("" if t[1] is None else f" [{t[1]:+.4f}, {t[2]:+.4f}]")


def print_fit(spec, fit, out: Path, *, chosen: str | None = None) -> None:
    """The fit's tables (mass by length, every estimator's slope) of the fitted ``spec``, and what went to
    ``out``: that spec, or the candidate ``--select`` ``chosen`` instead (which may have no n_ref)."""
    table = Table(title=f"Top-{spec.top_k} mass by context length (n_ref = {spec.n_ref}; "
                        f"reference mass {fit.mass_ref:.4f})")
    for col in ("n", "rows", f"mean top-{spec.top_k} mass", "fitted alpha"):
        table.add_column(col, justify="right")
    for b in fit.buckets:
        style = "bold" if b.n > spec.n_ref else None
        table.add_row(f"{b.n:,.0f}", f"{b.rows:,}", f"{b.mass:.4f}", fixed(b.alpha), style=style)
    console.print(table)
    slopes = Table(title="Slope beta in alpha(n) = 1 + beta ln(n / n_ref)")
    for col in ("estimator", "slope", "95% interval", "note"):
        slopes.add_column(col)
    for r in fit.results:
        mark = " [green](spec)[/]" if r.estimator == spec.calibration.estimator else ""
        interval = f"[{fixed(r.ci_low, 4)}, {fixed(r.ci_high, 4)}]" if r.ci_low is not None else "-"
        slopes.add_row(r.estimator + mark, fixed(r.slope, 4), interval, r.note or "")
    console.print(slopes)
    verdict = spec.calibration.verdict
    if verdict is not None:
        colour = {"dilution": "green", "distance": "yellow", "both": "yellow", "neither": "green"}[verdict.verdict]
        console.print(f"Dilution or distance drift past n_ref (seen distances d <= {verdict.window:,}): verdict "
                      f"[bold {colour}]{verdict.verdict}[/], {verdict.advice}", highlight=False)
        console.print(verdict.numbers(), highlight=False, soft_wrap=True)
        if verdict.note:
            console.print(f"[yellow]note:[/] {verdict.note}", highlight=False)
    if chosen not in (None, "spec"):
        console.print(f"Wrote [bold]{out}[/]: {chosen}, the deployment --select chose (below), not the fitted law",
                      soft_wrap=True)
        return
    what = "slopes" if spec.table is None else "table values"
    shape = "" if spec.granularity == "global" else f" ({spec.granularity} {what}, shape {spec.shape()})"
    console.print(f"Wrote [bold]{out}[/]{shape}", soft_wrap=True)  # a path is never broken across lines
    if spec.table is not None:
        t = spec.table
        console.print(f"Tabulated law: {len(t.n)} knots, {t.measured} calibrated up to n = {t.n[t.measured - 1]:,}"
                      + (f", {t.extrapolation} extrapolation to n = {t.n[-1]:,}" if t.extrapolation else "")
                      + "; alpha holds past the last knot")
