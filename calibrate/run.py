"""The calibrate job as a library function: corpus -> drafter -> row statistics -> slope -> spec.

``run_calibration(CalibrateOptions(...))`` is what ``sharpdraft calibrate`` runs:

1. load the drafter (``calibrate.drafters.load_drafter``) and settle ``n_ref`` (the drafter's
   default unless given) and ``max_length`` (``4 * n_ref`` unless given);
2. pack the corpus into ``sequences`` token sequences of ``max_length`` (``calibrate.corpus``);
3. per sequence, run the drafter with a ``RowCollector`` tap that keeps the rows whose visible-key
   count lies on a log-spaced grid (8 per octave from 32 to ``max_length``), all layers and
   heads, reduced at once to per-row statistics (``calibrate.collect``);
4. fit the slope with the E1/E2/E3 estimators (``sharpdraft_theory.estimators.fit_slopes``) and
   write the spec with its calibration record: log-linear with the chosen estimator's slope, or
   (``law="tabulated"``) E1's alpha per bucket, extrapolated to ``max_n``
   (``sharpdraft_theory.tabulate``).

Progress is saved as it goes: after each sequence its statistics are written atomically to
``<out>.partial/seq-NNNNN.npz``, next to ``run.json`` holding the run's parameters. A killed run
rerun with ``resume=True`` (``--resume``) checks the parameters match, keeps the saved sequences
and collects the rest; since sequences and their order are fixed, the spec equals that of one
uninterrupted run. The folder is removed once the spec is written. The fit's own parameters
(``n_ref``, ``top_k``, granularity, estimator) may change between the killed run and the resumed one.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from sharpdraft_theory import __version__
from sharpdraft_theory.estimators import ESTIMATORS, SlopeFit, fit_slopes
from sharpdraft_theory.spec import GRANULARITIES, Calibration, ScaleSpec
from sharpdraft_theory.stats import DEFAULT_ALPHA_GRID, RowStats
from sharpdraft_theory.tabulate import tabulate
from sharpdraft_theory.atomic import atomic_write_text
from sharpdraft_theory.laws import MAX_N, alpha_law

from .collect import DEFAULT_K_MAX, RowCollector, log_grid
from .corpus import pack
from .drafters import load_drafter, resolve_device, resolve_dtype
from .errors import UserError
from .preflight import check_corpus, check_outputs, local_inputs

__all__ = ["CalibrateOptions", "CalibrateResult", "Progress", "run_calibration", "partial_dir", "plausibility_notes"]

GRID_PER_OCTAVE = 8  # sampled n per doubling
GRID_N_MIN = 32  # shortest sampled n
# Plausibility (warnings in the summary, not refusals). Trained drafters fit slopes of about 0.05 to 0.5
# (Qwen's LogN scaling is slope 1 / ln n_ref, 0.13 at 2048); a slope past 1 more than quadruples the
# logits by 16 n_ref. No default --alpha-max: the spec's contract already keeps alpha finite and
# positive, and a cap would change the fitted law where it was measured; the warnings flag the rest.
PLAUSIBLE_SLOPE = 1.0
PLAUSIBLE_ALPHA_16 = 4.0
LAWS_WRITTEN = ("log-linear", "tabulated")  # the laws a calibration fits
MAX_N_PER_N_REF = 64  # a tabulated law's default reach: knots up to 64 n_ref


@dataclass(frozen=True)
class CalibrateOptions:
    """Everything ``sharpdraft calibrate`` takes (the CLI's options, same names)."""

    out: Path  # where the spec goes
    drafter: str = "hf"  # a kind of calibrate.drafters.KINDS
    drafter_path: str | None = None  # checkpoint folder, .gguf file or hub id; None: built-in default
    target_path: str | None = None  # target model (eagle3, dflash) or tokenizer source (hf, pard)
    corpus: str = "pydoc"  # pydoc[:train|heldout|all], a .txt / .jsonl file or a folder
    max_length: int | None = None  # tokens per sequence; None: 4 * n_ref
    sequences: int = 8  # sequences to read
    n_ref: int | None = None  # reference length; None: the drafter's default
    top_k: int = 4  # size of the top set whose mass the slope restores
    granularity: str = "global"  # global, layer or head
    estimator: str = "mass-matching"  # which estimator's slope the spec uses
    alpha_max: float | None = None  # cap written to the spec
    law: str = "log-linear"  # log-linear (one fitted slope) or tabulated (E1's alpha per bucket, then extrapolated)
    max_n: int | None = None  # tabulated: last extrapolated knot; None: MAX_N_PER_N_REF * n_ref
    device: str = "auto"  # auto, cpu, cuda[:N]
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16
    chunk: int | None = None  # query rows per chunk of the reduction; None: a 2 MiB logit budget
    stats: Path | None = None  # also save the per-row statistics here (.npz)
    resume: bool = False  # continue an interrupted run
    bootstrap: int = 200  # bootstrap resamples for the intervals
    aux_layer_reading: str | None = None  # sglang or vllm reading of a head's aux layer ids; None: by its framework


class Progress(Protocol):
    def start(self, total: int, done: int, tokens_per_sequence: int) -> None:
        """``total`` sequences, of which ``done`` are already saved (resume)."""

    def advance(self, tokens: int, rows: int) -> None:
        """One more sequence collected: its tokens and rows."""


@dataclass
class CalibrateResult:
    spec: ScaleSpec  # what was written to ``out``
    fit: SlopeFit  # every estimator's result, per-bucket details
    stats: RowStats  # all rows
    seconds: float  # wall time of collection in this run (resumed sequences excluded)
    tokens: int  # tokens collected in this run
    resumed: int  # sequences taken from a previous run's partial files
    notes: list[str] = field(default_factory=list)  # things the user should know


def partial_dir(out: Path) -> Path:
    """Folder of an interrupted run's saved sequences: ``<out>.partial``."""
    out = Path(out)
    return out.with_name(out.name + ".partial")


def run_calibration(opts: CalibrateOptions, *, drafter=None, progress: Progress | None = None) -> CalibrateResult:
    """Run a calibration (module docstring); ``drafter`` reuses an already loaded adapter."""
    _check_options(opts)
    device = resolve_device(opts.device)
    dtype = resolve_dtype(opts.dtype, device)
    _check_partial(partial_dir(opts.out), opts.resume)
    if drafter is None:
        drafter = load_drafter(opts.drafter, opts.drafter_path, opts.target_path, device, dtype,
                               aux_layer_reading=opts.aux_layer_reading)
    n_ref = opts.n_ref or drafter.default_n_ref
    max_length = opts.max_length or 4 * n_ref
    if n_ref < GRID_N_MIN:
        raise UserError(f"--n-ref {n_ref}: too short; the shortest sampled length is {GRID_N_MIN}")
    if n_ref >= max_length:
        raise UserError(f"--n-ref {n_ref} >= --max-length {max_length}: no rows beyond n_ref to fit; "
                        f"use --max-length {4 * n_ref} or a smaller --n-ref")
    _check_max_n(opts.max_n, n_ref)
    k_max = max(DEFAULT_K_MAX, opts.top_k)
    grid = log_grid(max_length, per_octave=GRID_PER_OCTAVE, n_min=max(GRID_N_MIN, 2 * k_max))
    notes: list[str] = list(getattr(drafter, "notes", ()))  # what the adapter read and how

    params = {"drafter": opts.drafter, "drafter_path": opts.drafter_path, "target_path": opts.target_path,
              "corpus": opts.corpus, "max_length": max_length, "dtype": str(dtype).removeprefix("torch."),
              "k_max": k_max, "grid": grid.tolist(), "alpha_grid": DEFAULT_ALPHA_GRID.tolist()}
    sequences = list(pack(opts.corpus, drafter.tokenize, drafter.eos_token_id, max_length, limit=opts.sequences))
    if len(sequences) < opts.sequences:
        notes.append(f"the corpus holds only {len(sequences)} sequences of {max_length} tokens "
                     f"(asked for {opts.sequences})")
    partial = _open_partial(partial_dir(opts.out), params, opts.resume, notes)
    collector = RowCollector(grid, k_max=k_max, alpha_grid=DEFAULT_ALPHA_GRID, chunk=opts.chunk)
    positions = torch.as_tensor(grid - 1)
    parts, resumed, tokens, seconds = [], 0, 0, 0.0
    saved = [partial / f"seq-{i:05d}.npz" for i in range(len(sequences))]
    done = sum(p.is_file() for p in saved)
    if progress is not None:
        progress.start(len(sequences), done, max_length)
    for i, ids in enumerate(sequences):
        if saved[i].is_file():
            parts.append(_load_part(saved[i]))
            resumed += 1
            continue
        started = time.perf_counter()
        collector.start(i)
        try:
            drafter.collect(torch.tensor([ids]), collector, positions)
        except torch.cuda.OutOfMemoryError:
            raise UserError(f"CUDA out of memory in sequence {i} ({max_length} tokens, chunk "
                            f"{opts.chunk or 'auto'}): pass a smaller --chunk (query rows per chunk, e.g. 8) "
                            "or --max-length; then --resume keeps the sequences already done") from None
        part = collector.take()
        _write(f"sequence {i} to {partial}", lambda: part.save(saved[i]), "then --resume to continue")
        parts.append(part)
        seconds += time.perf_counter() - started
        tokens += len(ids)
        if progress is not None:
            progress.advance(len(ids), part.rows)

    stats = RowStats.concat(parts)
    if opts.stats is not None:  # the rows and what they were collected and fitted with: readers need no flags
        meta = _stats_meta(opts, params, n_ref, len(sequences))
        _write(f"--stats {opts.stats}", lambda: stats.save(opts.stats, **meta), "then --resume to finish")
    try:
        fit = fit_slopes(stats, n_ref=n_ref, top_k=opts.top_k, granularity=opts.granularity,
                         bootstrap=opts.bootstrap, seed=0)
    except ValueError as err:
        raise UserError(f"cannot fit the slope: {err}") from None
    spec = _make_spec(opts, drafter, fit, stats, n_ref, max_length, len(sequences), notes)
    notes += plausibility_notes(spec, fit)
    _write(f"--out {opts.out}", lambda: spec.save(opts.out), "then --resume to finish")
    shutil.rmtree(partial, ignore_errors=True)
    return CalibrateResult(spec=spec, fit=fit, stats=stats, seconds=seconds, tokens=tokens, resumed=resumed,
                           notes=notes)


def _check_options(opts: CalibrateOptions) -> None:
    """Every option that can be checked without the model, before any work (and before any file is made)."""
    if opts.sequences < 1:
        raise UserError(f"--sequences {opts.sequences}: need at least 1")
    for option, value in (("--drafter-path", opts.drafter_path), ("--target-path", opts.target_path)):
        if value is not None and not str(value).strip():
            raise UserError(f"{option} is empty: give a checkpoint folder, a .gguf file or a hub id, or leave it out")
    if opts.top_k < 1:
        raise UserError(f"--top-k {opts.top_k}: need at least 1")
    if opts.max_length is not None and opts.max_length < 2 * GRID_N_MIN:
        raise UserError(f"--max-length {opts.max_length}: need at least {2 * GRID_N_MIN} tokens")
    if opts.granularity not in GRANULARITIES:
        raise UserError(f"--granularity {opts.granularity}: expected one of {', '.join(GRANULARITIES)}")
    if opts.estimator not in ESTIMATORS:
        raise UserError(f"--estimator {opts.estimator}: expected one of {', '.join(ESTIMATORS)}")
    if opts.chunk is not None and opts.chunk < 1:
        raise UserError(f"--chunk {opts.chunk}: need at least 1 query row per chunk")
    if opts.alpha_max is not None and not (math.isfinite(opts.alpha_max) and opts.alpha_max >= 1):
        raise UserError(f"--alpha-max {opts.alpha_max}: expected a finite number >= 1")
    if opts.n_ref is not None and not GRID_N_MIN <= opts.n_ref <= MAX_N:
        raise UserError(f"--n-ref {opts.n_ref}: expected {GRID_N_MIN} (the shortest sampled length) to 2^32")
    if opts.n_ref is not None and opts.top_k >= opts.n_ref:
        raise UserError(f"--top-k {opts.top_k}: must be below --n-ref {opts.n_ref}")
    if opts.max_length is not None and opts.n_ref is not None and opts.n_ref >= opts.max_length:
        raise UserError(f"--n-ref {opts.n_ref} >= --max-length {opts.max_length}: no rows beyond n_ref to fit; "
                        f"use --max-length {4 * opts.n_ref} or a smaller --n-ref")
    if opts.bootstrap < 0:
        raise UserError(f"bootstrap {opts.bootstrap}: need at least 0 resamples")
    if opts.law not in LAWS_WRITTEN:
        raise UserError(f"--law {opts.law}: calibration writes one of {', '.join(LAWS_WRITTEN)}")
    if opts.law == "tabulated" and opts.estimator != "mass-matching":
        raise UserError(f"--estimator {opts.estimator} with --law tabulated: the table holds mass matching's alpha "
                        "per bucket; drop --estimator, or use --law log-linear")
    if opts.max_n is not None and opts.law != "tabulated":
        raise UserError(f"--max-n {opts.max_n}: only --law tabulated extrapolates to a maximum length")
    if opts.n_ref is not None:  # else once the drafter has said its n_ref
        _check_max_n(opts.max_n, opts.n_ref)
    check_outputs({"--out": Path(opts.out), "--stats": opts.stats},
                  local_inputs(corpus=opts.corpus, drafter_path=opts.drafter_path, target_path=opts.target_path))
    check_corpus(opts.corpus)


def _check_max_n(max_n: int | None, n_ref: int) -> None:
    if max_n is not None and not n_ref < max_n <= MAX_N:
        raise UserError(f"--max-n {max_n}: expected more than n_ref={n_ref} (the table's knots lie past it) "
                        "and at most 2^32")


def _check_partial(folder: Path, resume: bool) -> None:
    """An interrupted run at ``folder`` is continued only with ``--resume``; a file there is in the way."""
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{folder} is a file where the run keeps its progress; move or delete it")
    if (folder / "run.json").is_file() and not resume:
        raise UserError(f"{folder} holds an interrupted run: pass --resume to continue it, "
                        "or delete the folder to start over")


def _write(what: str, write, then: str) -> None:
    """Run ``write()``; an ``OSError`` (disk full, permissions) is a ``UserError`` naming ``what``."""
    try:
        write()
    except OSError as err:
        raise UserError(f"cannot write {what}: {err.strerror or err}; free space or fix the path, {then}") from None


def _open_partial(folder: Path, params: dict, resume: bool, notes: list[str]) -> Path:
    """Create (or, resuming, check) the partial folder; return it."""
    run_file = folder / "run.json"
    if run_file.is_file():  # _check_partial has refused it already without --resume
        try:
            before = json.loads(run_file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise UserError(f"{run_file}: cannot read it ({err}); delete {folder} to start over") from None
        for key, value in params.items():
            if before.get(key) != value:
                shown = "(differs)" if key in ("grid", "alpha_grid") else f"{before.get(key)!r}, now {value!r}"
                raise UserError(f"--resume: {key} does not match the interrupted run in {folder}: was {shown}; "
                                "rerun with the same options, or delete the folder to start over")
        return folder
    if resume:
        notes.append(f"nothing to resume at {folder}: started from the beginning")
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_file, json.dumps(params, indent=1))
    return folder


def _load_part(path: Path) -> RowStats:
    try:
        part, _ = RowStats.load(path)
    except ValueError as err:
        raise UserError(f"--resume: {err}; delete {path} to collect that sequence again") from None
    return part


def _stats_meta(opts: CalibrateOptions, params: dict, n_ref: int, sequences: int) -> dict[str, str]:
    """Metadata of the ``--stats`` file, each value JSON-encoded (``calibrate.plots.load_stats`` decodes it).

    The collection parameters and the fit's settings; not the grids nor ``k_max``, which the
    arrays themselves hold (``stats.n``, ``stats.alpha_grid``, ``stats.top``).
    """
    meta = {k: v for k, v in params.items() if k not in ("grid", "alpha_grid", "k_max")}
    meta.update(sequences=sequences, n_ref=n_ref, top_k=opts.top_k, granularity=opts.granularity,
                estimator=opts.estimator, tool_version=__version__)
    return {k: json.dumps(v) for k, v in meta.items()}


def plausibility_notes(spec: ScaleSpec, fit: SlopeFit) -> list[str]:
    """Warnings for a fit no drafter should give (e.g. a random-weight model): a slope above
    ``PLAUSIBLE_SLOPE``, alpha at ``16 n_ref`` above the cap (or ``PLAUSIBLE_ALPHA_16`` without
    one), a 95% interval wider than the slope itself. A tabulated spec's slopes are mass matching's."""
    notes = []
    slopes = spec.slopes() if spec.table is None else np.asarray(fit.slopes["mass-matching"])
    table = None if spec.table is None else (spec.table.n, spec.values())
    alpha16 = float(np.max(alpha_law(spec.law, 16.0 * spec.n_ref, n_ref=spec.n_ref, slope=spec.slopes(),
                                     table=table)))  # uncapped, at 16 n_ref
    limit = spec.alpha_max if spec.alpha_max is not None else PLAUSIBLE_ALPHA_16
    if slopes.max() > PLAUSIBLE_SLOPE:
        notes.append(f"slope {slopes.max():.4f} is beyond the plausible range (0, {PLAUSIBLE_SLOPE:g}]: check that the "
                     "drafter is trained and the corpus is text it knows")
    if alpha16 > limit:
        notes.append(f"alpha(16 n_ref) = {alpha16:.3g} exceeds " + (f"--alpha-max {limit:g}" if spec.alpha_max
                     is not None else f"{limit:g}, more than any trained drafter needs") + "; treat this spec with care")
    result = fit.result(spec.calibration.estimator)
    if result.ci_low is not None and result.slope is not None and result.ci_high - result.ci_low > abs(result.slope):
        notes.append(f"the 95% interval [{result.ci_low:.4f}, {result.ci_high:.4f}] is wider than the slope "
                     f"{result.slope:.4f}: collect more --sequences")
    return notes


def _make_spec(opts: CalibrateOptions, drafter, fit: SlopeFit, stats: RowStats, n_ref: int, max_length: int,
               sequences: int, notes: list[str]) -> ScaleSpec:
    slope = np.asarray(fit.slopes[opts.estimator], dtype=np.float64)
    if not np.all(np.isfinite(slope)):
        result = fit.result(opts.estimator)
        others = [r.estimator for r in fit.results if r.slope is not None and r.estimator != opts.estimator]
        raise UserError(f"the {opts.estimator} estimator is undefined on this data ({result.note or 'no finite slope'})"
                        + (f"; try --estimator {others[0]}" if others and opts.law == "log-linear" else ""))
    calibration = Calibration(estimator=opts.estimator, corpus=opts.corpus, sequences=sequences,
                              max_length=max_length, rows=stats.rows, buckets=fit.buckets, results=fit.results,
                              tool_version=__version__)
    if opts.law == "tabulated":
        try:
            table, filled = tabulate(fit, n_ref=n_ref, max_n=opts.max_n or MAX_N_PER_N_REF * n_ref)
        except ValueError as err:
            raise UserError(f"cannot tabulate alpha: {err}") from None
        if filled:
            notes.append(f"{filled} {opts.granularity} values of the table were out of the alpha grid's reach "
                         "(or had no rows) and took the global bucket's alpha")
        law = dict(slope=None, table=table)
    else:
        if np.any(slope < 0):  # the spec's contract (alpha > 0 for every n) allows no negative log-linear slope
            notes.append(f"{int(np.sum(slope < 0))} of {slope.size} fitted slopes were negative (the mass did not "
                         f"dilute there, min {slope.min():.4f}); the spec holds 0 for them")
            slope = np.maximum(slope, 0.0)
        law = dict(slope=float(slope) if slope.ndim == 0 else slope.tolist())
    return ScaleSpec(law=opts.law, n_ref=n_ref, top_k=opts.top_k, granularity=opts.granularity,
                     alpha_max=opts.alpha_max, drafter=drafter.info, calibration=calibration, **law)
