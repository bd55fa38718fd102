"""The ``sharpdraft`` command line: thin typer commands over library functions.

User errors print one line (``error: ...``) and exit 1: a ``UserError`` from the commands (library
code turns file, decode and spec errors into one at its own boundary), and a bad or missing
option, which click would report in a box with exit 2. Set ``SHARPDRAFT_DEBUG=1`` to see the
traceback of a ``UserError`` instead. Any other exception is a bug and keeps its traceback.
Ctrl-C exits 130.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer._click.exceptions import ClickException, NoArgsIsHelpError  # typer's own copy of click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .distributed import is_main_process
from .errors import UserError

app = typer.Typer(
    name="sharpdraft",
    help="Cardinality-aware query scaling for speculative-decoding drafters: predict, calibrate, fit, inspect.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)


def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


@app.command()
def predict(
    *,
    stats: Annotated[Optional[Path], typer.Option(help="Predict from measured statistics (`calibrate --stats`) "
                                                  "with the distance model instead of a score model.")] = None,
    model: Annotated[Optional[str], typer.Option(help="Score model: two-level (background at one value) or gaussian "
                                                 "(default gaussian).")] = None,
    gap: Annotated[Optional[float], typer.Option(help="Gap D between the top logits and the background mean "
                                                 "(logit units; default 6).")] = None,
    sigma: Annotated[Optional[float], typer.Option(help="Background standard deviation (gaussian only).")] = None,
    top_k: Annotated[Optional[int], typer.Option("--top-k", help="Size of the top set whose mass is tracked "
                                                 "(default 4, or the statistics file's).")] = None,
    n_ref: Annotated[Optional[int], typer.Option("--n-ref", help="Reference length: the drafter's training context "
                                                 "(default 512, or the statistics file's).")] = None,
    n: Annotated[Optional[list[int]], typer.Option("--n", help="Context length to evaluate; repeat the option.")] = None,
    mc_rows: Annotated[int, typer.Option("--mc-rows", help="Check masses by quenched Monte Carlo with this many rows "
                                         "(0: annealed formulas).")] = 0,
    tail: Annotated[str, typer.Option(help="With --stats: the profile's form past the calibrated distances, "
                                      "power or lognormal.")] = "power",
    bootstrap: Annotated[int, typer.Option(help="With --stats: resamples of sequences for the alpha band.")] = 100,
    seed: Annotated[int, typer.Option(help="Monte Carlo and bootstrap seed.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
):
    """Predict top-k mass dilution and the query scale that undoes it, under a score model or from statistics."""
    from .predict import predict as run_predict
    from .predict import predict_from_stats

    if stats is not None:
        given = [name for name, value in (("--model", model), ("--gap", gap), ("--sigma", sigma)) if value is not None]
        if given or mc_rows:
            raise UserError(f"{(given or ['--mc-rows'])[0]} describes a score model; drop it when predicting from --stats")
        result = predict_from_stats(stats, n=n, n_ref=n_ref, top_k=top_k, tail=tail, bootstrap=bootstrap, seed=seed)
        if as_json:
            print(json.dumps(result, indent=2))
        else:
            _show_stats_prediction(result)
        return
    model = model or "gaussian"
    gap = 6.0 if gap is None else gap
    top_k = 4 if top_k is None else top_k
    n_ref = 512 if n_ref is None else n_ref
    if model == "gaussian" and sigma is None:
        sigma = 1.0
    lengths = n or [1024, 4096, 16384, 65536]
    result = run_predict(model=model, gap=gap, sigma=sigma, top_k=top_k, n_ref=n_ref, n=lengths,
                         mc_rows=mc_rows, seed=seed)
    if as_json:
        print(json.dumps(result, indent=2))
        return
    desc = f"{model}, gap {gap:g}" + (f", sigma {sigma:g}" if sigma is not None else "") + f", top-{top_k}"
    console.print(f"[bold]Score model[/]: {desc}; reference length n_ref = {n_ref}")
    console.print(f"Top-{top_k} mass at n_ref: [bold]{result['mass_ref']:.4f}[/] ({result['mass_model']}); "
                  f"tangent slope beta = {result['beta_tangent']:.4f}"
                  + (f", least-squares slope over [{n_ref}, {result['least_squares_range'][1]:.0f}] = "
                     f"{result['beta_least_squares']:.4f}" if result["beta_least_squares"] is not None else ""))
    horizon = result["horizon_n"]
    console.print("Correction horizon: " + ("none (any length can be restored)" if horizon is None
                                            else f"n = {horizon:.4g} (past it no query scale restores the mass)"))
    table = Table(title="Top-k mass versus context length")
    for col in ("n", "mass (alpha=1)", "alpha exact", "mass (exact)", "alpha fixed-slope", "mass (fixed)", "regime"):
        table.add_column(col, justify="right")
    for row in result["rows"]:
        table.add_row(str(row["n"]), _fmt(row["mass_unscaled"]), _fmt(row["alpha_exact"]),
                      _fmt(row["mass_exact"]) if row["note"] is None else "[yellow]*[/]",
                      _fmt(row["alpha_fixed_slope"]), _fmt(row["mass_fixed_slope"]), row["regime"])
    console.print(table)
    for row in result["rows"]:
        if row["note"] is not None:
            console.print(f"[yellow]*[/] n = {row['n']}: {row['note']}")
    console.print("alpha exact keeps the top-k mass at its n_ref value; alpha fixed-slope is the deployed law "
                  "1 + beta ln(n / n_ref). Regime: where the annealed sum behind the formulas holds "
                  "(annealed), drifts (crossover) or fails (frozen).")


def _show_stats_prediction(result: dict) -> None:
    console.print(f"[bold]Distance model[/] from {result['stats']} ({result['sequences']} sequences, calibrated up to "
                  f"n = {result['longest_calibrated_n']}, {result['tail']} tail); top-{result['top_k']} reference mass "
                  f"{result['mass_ref']:.4f} at n_ref = {result['n_ref']}; power-law gamma {result['gamma_power_law']:.3f}")
    table = Table(title="Top-k mass (alpha = 1) and the exact correction")
    for col in ("n", "distance model", "power law", "i.i.d. law", "alpha exact", "95% band"):
        table.add_column(col, justify="right")
    for row in result["rows"]:
        band = f"[{_fmt(row['alpha_low'], 3)}, {_fmt(row['alpha_high'], 3)}]" if row["alpha_low"] is not None else "-"
        table.add_row(f"{row['n']}" + ("*" if row["extrapolated"] else ""), _fmt(row["mass_unscaled"]),
                      _fmt(row["mass_power_law"]), _fmt(row["mass_iid"]), _fmt(row["alpha_exact"], 3), band)
    console.print(table)
    horizon = result["horizon_n"]
    console.print("* past the calibrated lengths (the profile's fitted tail). Correction horizon: "
                  + ("none found below 2^40" if horizon is None else f"n = {horizon:.4g} (no alpha on the grid restores "
                                                                     "the mass past it)"))


@app.command()
def inspect(spec: Annotated[Path, typer.Argument(help="Scale spec JSON file to validate and show.")]):
    """Validate a scale spec and print it."""
    from .preflight import load_spec

    s = load_spec(spec)
    table = Table(title=f"{spec} ({s.schema})", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    table.add_row("law", s.law)
    table.add_row("n_ref", _fmt(s.n_ref))
    slopes = s.slopes()
    if s.table is not None:
        t, values = s.table, s.values()
        made = "hand-written" if t.measured is None else (
            f"{t.measured} calibrated" + (f", {len(t.n) - t.measured} by {t.extrapolation}" if t.extrapolation else ""))
        table.add_row("table", f"{len(t.n)} knots, n = {t.n[0]:,} to {t.n[-1]:,} ({made}); {s.granularity} values, "
                               f"shape {values.shape}, min {values.min():.4f}, max {values.max():.4f}")
    elif slopes is None:
        table.add_row("slope", "- (qwen-logn: 1 / ln n_ref)")
    elif slopes.ndim == 0:
        table.add_row("slope", f"{float(slopes):.4f}")
    else:
        table.add_row("slope", f"{s.granularity}: shape {tuple(slopes.shape)}, mean {slopes.mean():.4f}, "
                               f"min {slopes.min():.4f}, max {slopes.max():.4f}")
    table.add_row("top_k", str(s.top_k))
    table.add_row("alpha_max", _fmt(s.alpha_max))
    if s.positions is not None:
        table.add_row("positions", s.positions.describe())
    if s.drafter is not None:
        d = s.drafter
        table.add_row("drafter", f"{d.kind} {d.path or '(built-in)'}: {d.num_layers} layers, {d.num_heads} heads "
                                 f"({d.num_kv_heads} kv), head_dim {d.head_dim}")
    if s.calibration is not None:
        c = s.calibration
        table.add_row("calibration", f"{c.estimator} on {c.corpus}: {c.sequences} sequences x {c.max_length} tokens, "
                                     f"{c.rows} rows (sharpdraft {c.tool_version})")
        for r in c.results:
            ci = f" [{_fmt(r.ci_low)}, {_fmt(r.ci_high)}]" if r.ci_low is not None else ""
            table.add_row(f"  {r.estimator}", f"{_fmt(r.slope)}{ci}" + (f"  ({r.note})" if r.note else ""))
    if s.window is not None or s.sinks:
        table.add_row("window", f"{s.window or '-'} keys" + (f", {s.sinks} sinks" if s.sinks else ""))
    console.print(table)
    if s.calibration is not None and s.calibration.selection is not None:
        from .calibrate_cmd import print_selection

        print_selection(s.calibration.selection)
    if s.table is not None:
        console.print(_knots_table(s))
    if s.law != "qwen-logn" or s.n_ref:
        grid = ([256 << i for i in range(8)] if s.n_ref is None  # n_ref / 2 .. 64 n_ref otherwise
                else [max(2, s.n_ref // 2)] + [s.n_ref << i for i in range(7)])
        grouped = s.granularity != "global"
        alphas = s.alpha(grid, layer=0) if grouped else s.alpha(grid)
        shown = [float(a.mean()) if getattr(a, "ndim", 0) else float(a) for a in alphas]
        console.print("alpha(n)" + (" (layer 0, mean over heads)" if grouped else "") + ": "
                      + ", ".join(f"{n}: {a:.3f}" for n, a in zip(grid, shown)))


def _knots_table(s) -> Table:
    """A tabulated spec's knots: alpha over its layers and heads at each, and where each came from."""
    t = s.table
    values = s.values().reshape(-1, len(t.n))  # (layers x heads, knots)
    cap = "" if s.alpha_max is None else f"; capped at {s.alpha_max:g} when applied"
    knots = Table(title="alpha at the knots, over layers and heads",
                  caption=f"1 up to n_ref = {s.n_ref}, linear in ln n between knots, held past the last{cap}")
    for col in ("n", "mean alpha", "min", "max", "from"):
        knots.add_column(col, justify="right")
    for j, n in enumerate(t.n):
        source = "-" if t.measured is None else "calibration" if j < t.measured else t.extrapolation
        knots.add_row(f"{n:,}", f"{values[:, j].mean():.4f}", f"{values[:, j].min():.4f}", f"{values[:, j].max():.4f}",
                      source)
    return knots


from .calibrate_cmd import calibrate as _calibrate; app.command(name="calibrate")(_calibrate)  # noqa: E402, E702
from .plot_cmd import plot as _plot; app.command(name="plot")(_plot)  # noqa: E402, E702
from .eval_cmd import eval_command as _eval; app.command(name="eval")(_eval)  # noqa: E402, E702
from .fit_cmd import fit as _fit; app.command(name="fit")(_fit)  # noqa: E402, E702
from .generate_cmd import generate as _generate; app.command(name="generate")(_generate)  # noqa: E402, E702
from .bench_cmd import bench as _bench; app.command(name="bench")(_bench)  # noqa: E402, E702
from .export_cmd import export as _export; app.command(name="export")(_export)  # noqa: E402, E702


def _fail(message: str) -> None:
    err_console.print(f"[red]error:[/] {escape(' '.join(message.split()))}", highlight=False, soft_wrap=True)
    raise SystemExit(1)


def _bad_value(err: ClickException) -> str | None:
    """``--gap abc: expected a number`` for a value typer could not convert, naming the value typed;
    None for other usage errors (typer converts through pydantic, whose errors hold the input)."""
    param, cause = getattr(err, "param", None), err.__cause__
    problems = cause.errors() if param is not None and hasattr(cause, "errors") else []
    if not problems or not isinstance(problems[0].get("input"), str):
        return None
    expected = {"int_parsing": "an integer written in digits", "float_parsing": "a number"}.get(
        problems[0].get("type"), problems[0].get("msg", "another value").removeprefix("Input should be "))
    name = max(param.opts, key=len) if param.opts else param.name
    return f"{name} {problems[0]['input']}: expected {expected}"


def main() -> None:
    """Console-script entry point: run the app, turning user errors into one line and exit 1."""
    try:
        status = app(standalone_mode=False)
    except UserError as err:
        if os.environ.get("SHARPDRAFT_DEBUG"):
            raise
        if not is_main_process():  # under torchrun rank 0 prints the error of any rank (calibrate.distributed)
            raise SystemExit(1) from None
        _fail(str(err))
    except NoArgsIsHelpError as err:
        typer.echo(err.ctx.get_help())
        raise SystemExit(0) from None
    except ClickException as err:  # a bad or missing option: one line too, exit 1 (the README's promise)
        command = err.ctx.command_path if getattr(err, "ctx", None) else "sharpdraft"
        _fail(f"{_bad_value(err) or err.format_message()} (see `{command} --help`)")
    except typer.Abort:  # end of input at a prompt
        raise SystemExit(130) from None
    raise SystemExit(status if isinstance(status, int) else 0)  # Ctrl-C comes back as 130
