"""The calibrate job as a library function: corpus -> drafter -> row statistics -> slope -> spec.

``run_calibration(CalibrateOptions(...))`` is what ``sharpdraft calibrate`` runs:

1. load the drafter (``calibrate.drafters.load_drafter``) and settle ``n_ref`` (the drafter's
   default unless given) and ``max_length`` (``4 * n_ref`` unless given);
2. pack the corpus into ``sequences`` token sequences of ``max_length`` (``calibrate.corpus``);
3. per sequence, run the drafter with a ``RowCollector`` tap that keeps the rows whose visible-key
   count lies on a log-spaced grid (8 per octave from 32 to ``max_length``), all layers and
   heads, reduced at once to per-row statistics (``calibrate.collect``);
4. fit the slope and build the spec with its calibration record (``calibrate.fit.fit_spec``, the
   fitting path ``sharpdraft fit`` shares): log-linear with the chosen estimator's slope, or
   (``law="tabulated"``) E1's alpha per bucket, extrapolated to ``max_n``; and write it.

Under ``torchrun`` the sequences are shared among the ranks, sequence ``i`` on rank
``i mod WORLD_SIZE``, and rank 0 gathers every sequence's rows, in sequence order, then fits and
writes the spec and statistics alone (``calibrate.distributed``): the spec is byte for byte that
of one process. Other ranks write only their partial files and return None.

Progress is saved as it goes: after each sequence its statistics are written atomically to
``<out>.partial/seq-NNNNN.npz``, next to ``run.json`` holding the run's parameters. A killed run
rerun with ``resume=True`` (``--resume``) checks the parameters match, keeps the saved sequences
and collects the rest; since sequences and their order are fixed, the spec equals that of one
uninterrupted run, whatever the world size of either. The folder is removed once the spec is
written. The fit's own parameters (``n_ref``, ``top_k``, granularity, estimator) may change
between the killed run and the resumed one, except ``n_ref`` for a run that writes statistics:
there it is also the window of the attention budget its saved sequences hold.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from sharpdraft_theory.estimators import SlopeFit
from sharpdraft_theory.spec import ScaleSpec
from sharpdraft_theory.stats import DEFAULT_ALPHA_GRID, DISTANCE_ALPHAS, RowStats
from sharpdraft_theory.atomic import atomic_write_text
from sharpdraft_theory.laws import MAX_N

from .collect import DEFAULT_K_MAX, RowCollector, log_grid
from .corpus import pack
from .distributed import Ranks
from .drafters import default_drafter_path, drafter_kind, load_drafter, resolve_device, resolve_dtype
from .drafters.pard_smollm2 import cut_from_smollm2
from .errors import UserError
from .fit import (LAWS_WRITTEN, MAX_N_PER_N_REF, Collection, FitSettings, check_fit_options, check_max_n, fit_spec,
                  plausibility_notes, record_meta)
from .generated import check_tokenizer, is_generated
from .measure.saved import check_params, partial_dir
from .preflight import check_corpus, check_outputs, local_inputs
from .smollm2 import SMOLLM2_N_REF

__all__ = ["CalibrateOptions", "CalibrateResult", "Progress", "check_options", "run_calibration", "partial_dir",
           "plausibility_notes", "LAWS_WRITTEN", "MAX_N_PER_N_REF"]

GRID_PER_OCTAVE = 8  # sampled n per doubling
GRID_N_MIN = 32  # shortest sampled n
KEEP_STATES_BYTES = 1 << 30  # --select: target states kept from the collection for the selection, at most


@dataclass(frozen=True)
class CalibrateOptions:
    """Everything ``sharpdraft calibrate`` takes (the CLI's options, same names)."""

    out: Path  # where the spec goes
    drafter: str = "hf"  # a kind of calibrate.drafters.KINDS
    drafter_path: str | None = None  # checkpoint folder, .gguf file or hub id; None: built-in default
    target_path: str | None = None  # target model (eagle3, dflash) or tokenizer source (hf, pard)
    corpus: str = "pydoc"  # pydoc[:train|heldout|all], a .txt / .jsonl file, a folder or generated:NAME[:SPLIT]
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
    select: bool = False  # measure candidate deployments after the fit and write the winner (calibrate.select)


class Progress(Protocol):
    def start(self, total: int, done: int, tokens_per_sequence: int) -> None:
        """``total`` sequences, of which ``done`` are already saved (resume)."""

    def advance(self, tokens: int, rows: int) -> None:
        """One more sequence collected: its tokens and rows."""


@dataclass
class CalibrateResult:
    spec: ScaleSpec  # what was written to ``out``
    fitted: ScaleSpec  # the fit's spec: ``spec`` itself, unless --select wrote another deployment
    fit: SlopeFit  # every estimator's result, per-bucket details
    stats: RowStats  # all rows
    seconds: float  # wall time of collection in this run (resumed sequences excluded; the slowest rank's)
    tokens: int  # tokens collected in this run, all ranks together
    resumed: int  # sequences taken from a previous run's partial files
    world_size: int = 1  # processes that collected
    notes: list[str] = field(default_factory=list)  # things the user should know
    selection: dict | None = None  # calibrate --select: the candidates, the choice and its seconds


def run_calibration(opts: CalibrateOptions, *, drafter=None,
                    progress: Progress | None = None) -> CalibrateResult | None:
    """Run a calibration (module docstring); ``drafter`` reuses an already loaded adapter.

    Under torchrun every rank calls this; rank 0 returns the result, the others None, and
    ``progress`` follows rank 0's own sequences.
    """
    check_options(opts)
    ranks = Ranks.from_environment()
    device = resolve_device(ranks.device_option(opts.device))
    ranks.check_device(device)
    dtype = resolve_dtype(opts.dtype, device)
    with ranks.group(device):
        return _run(opts, ranks, device, dtype, drafter, progress)


@dataclass
class _Setup:
    """What every rank settles before collecting: the same on all of them."""

    drafter: object  # the loaded adapter (calibrate.drafters.base.Adapter)
    n_ref: int  # reference length
    max_length: int  # tokens per sequence
    grid: np.ndarray  # sampled visible-key counts
    k_max: int  # top logits kept per row
    params: dict  # the run's parameters, as run.json holds them
    sequences: list[list[int]]  # the corpus, packed
    notes: list[str]  # things the user should know
    # --select: sequence index -> the target states its collection kept (the drafter's keeps_target_states),
    # on the host, so the selection does not run the target again; rank 0's own sequences, up to KEEP_STATES_BYTES
    states: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)


def _run(opts: CalibrateOptions, ranks: Ranks, device, dtype, drafter, progress) -> CalibrateResult | None:
    # Every step that can fail on one rank only runs inside ranks.agree, so all ranks stop together.
    folder = partial_dir(opts.out)
    setup = ranks.agree(lambda: _prepare(opts, folder, device, dtype, drafter))
    # Rank 0 opens (or checks, resuming) the folder first; then the others join it: on a shared
    # filesystem it is the same folder, on a node's own disk the rank's own.
    ranks.agree(lambda: _open_partial(folder, setup.params, opts.resume, setup.notes) if ranks.main else None)
    ranks.agree(lambda: None if ranks.main else _open_partial(folder, setup.params, True, []))
    mine = [i for i in range(len(setup.sequences)) if ranks.owns(i)]
    shard = ranks.agree(lambda: _collect(opts, setup, mine, folder, progress, keep=opts.select and ranks.main))
    shards = ranks.gather(shard)
    done = ranks.agree(lambda: _finish(opts, setup, shards) if ranks.main else None)
    shutil.rmtree(folder, ignore_errors=True)
    if not ranks.main:
        return None
    spec, fitted, fit, stats = done
    return CalibrateResult(spec=spec, fitted=fitted, fit=fit, stats=stats, seconds=max(s.seconds for s in shards),
                           tokens=sum(s.tokens for s in shards), resumed=sum(s.resumed for s in shards),
                           world_size=ranks.world_size, notes=setup.notes,
                           selection=spec.calibration.selection if spec.calibration else None)


def _prepare(opts: CalibrateOptions, folder: Path, device, dtype, drafter) -> _Setup:
    """Refuse a stale partial folder, load the drafter, settle the lengths, pack the corpus."""
    _check_partial(folder, opts.resume)
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
    check_max_n(opts.max_n, n_ref)
    _check_top_k(opts.top_k, n_ref, "--n-ref" if opts.n_ref else "the drafter's n_ref")
    k_max = max(DEFAULT_K_MAX, opts.top_k)
    grid = log_grid(max_length, per_octave=GRID_PER_OCTAVE, n_min=_first_sampled_n(opts.top_k))
    notes: list[str] = list(getattr(drafter, "notes", ()))  # what the adapter read and how

    # drafter_path: the drafter as loaded (the built-in default's folder), so a changed default does not resume
    params = {"drafter": opts.drafter, "drafter_path": default_drafter_path(opts.drafter, opts.drafter_path),
              "target_path": opts.target_path,
              "corpus": opts.corpus, "max_length": max_length, "dtype": str(dtype).removeprefix("torch."),
              "k_max": k_max, "grid": grid.tolist(), "alpha_grid": DEFAULT_ALPHA_GRID.tolist(),
              # the distance profile (predict --stats) is only kept in a statistics file, so it is only
              # collected for one (it costs about a tenth of the collection); a tabulated spec reads it
              # to extrapolate its knots, and takes the fixed slope without it
              "distance_profile": opts.stats is not None,
              # so is the attention budget (plot's budget.png), its window the last n_ref keys
              "budget_window": n_ref if opts.stats is not None else None}
    if is_generated(opts.corpus):  # the drafter's tokenizer, where check_options could not read it alone
        check_tokenizer(opts.corpus, drafter.tokenizer, "the drafter's")
    sequences = list(pack(opts.corpus, drafter.tokenize, drafter.eos_token_id, max_length, limit=opts.sequences))
    if len(sequences) < opts.sequences:
        notes.append(f"the corpus holds only {len(sequences)} sequences of {max_length} tokens "
                     f"(asked for {opts.sequences})")
    return _Setup(drafter=drafter, n_ref=n_ref, max_length=max_length, grid=grid, k_max=k_max, params=params,
                  sequences=sequences, notes=notes)


@dataclass
class _Shard:
    """One rank's sequences: their rows, and what collecting them took."""

    parts: dict[int, RowStats]  # sequence index -> its rows
    seconds: float  # wall time of collection (resumed sequences excluded)
    tokens: int  # tokens collected
    resumed: int  # sequences taken from partial files


def _collect(opts: CalibrateOptions, setup: _Setup, mine: list[int], folder: Path,
             progress: Progress | None, keep: bool = False) -> _Shard:
    """Collect (or load, when saved) the sequences ``mine``, saving each as soon as it is done; ``keep``: also
    keep the target states of the sequences collected here in ``setup.states`` (``_keep``)."""
    collector = RowCollector(setup.grid, k_max=setup.k_max, alpha_grid=DEFAULT_ALPHA_GRID, chunk=opts.chunk,
                             distance_alphas=DISTANCE_ALPHAS if setup.params["distance_profile"] else None,
                             budget_window=setup.params["budget_window"])
    positions = torch.as_tensor(setup.grid - 1)
    shard = _Shard(parts={}, seconds=0.0, tokens=0, resumed=0)
    saved = {i: folder / f"seq-{i:05d}.npz" for i in mine}
    if progress is not None:
        progress.start(len(mine), sum(p.is_file() for p in saved.values()), setup.max_length)
    for i in mine:
        if saved[i].is_file():
            shard.parts[i] = _load_part(saved[i])
            shard.resumed += 1
            continue
        ids = setup.sequences[i]
        started = time.perf_counter()
        collector.start(i)
        try:
            kept = _collect_sequence(setup.drafter, torch.tensor([ids]), collector, positions, keep)
            part = collector.take()
        except torch.cuda.OutOfMemoryError:
            raise UserError(f"CUDA out of memory in sequence {i} ({setup.max_length} tokens, chunk "
                            f"{opts.chunk or 'auto'}): pass a smaller --chunk (query rows per chunk, e.g. 8) "
                            "or --max-length; then --resume keeps the sequences already done") from None
        _write(f"sequence {i} to {folder}", lambda: part.save(saved[i]), "then --resume to continue")
        shard.parts[i] = part
        _keep(setup.states, i, kept)
        shard.seconds += time.perf_counter() - started
        shard.tokens += len(ids)
        if progress is not None:
            progress.advance(len(ids), part.rows)
    return shard


def _collect_sequence(drafter, input_ids: torch.Tensor, collector: RowCollector, positions: torch.Tensor,
                      keep: bool) -> tuple[torch.Tensor, ...] | None:
    """The drafter's collection pass over ``input_ids`` (1, T) into ``collector``; with ``keep``, the target
    states it returns when its kind keeps them (``keeps_target_states``), else None."""
    if keep and getattr(drafter, "keeps_target_states", False):
        return drafter.collect(input_ids, collector, positions, keep_states=True)
    drafter.collect(input_ids, collector, positions)
    return None


def _keep(states: dict, i: int, kept: tuple[torch.Tensor, ...] | None) -> None:
    """Keep sequence ``i``'s target states on the host while all kept stay within ``KEEP_STATES_BYTES``; a
    sequence past it has its target run again by the selection."""
    if kept is None:
        return
    held = sum(t.nbytes for tensors in states.values() for t in tensors)
    if held + sum(t.nbytes for t in kept) <= KEEP_STATES_BYTES:
        states[i] = tuple(t.cpu() for t in kept)


def _finish(opts: CalibrateOptions, setup: _Setup,
            shards: list[_Shard]) -> tuple[ScaleSpec, ScaleSpec, SlopeFit, RowStats]:
    """Rank 0: join the shards in sequence order, save the statistics, fit, write the spec; return the
    written spec, the fitted one, the fit and the rows."""
    parts = {i: part for shard in shards for i, part in shard.parts.items()}
    stats = RowStats.concat([parts[i] for i in sorted(parts)])
    collection = Collection(drafter=opts.drafter, drafter_path=opts.drafter_path, target_path=opts.target_path,
                            aux_layer_reading=opts.aux_layer_reading, drafter_info=setup.drafter.info,
                            corpus=opts.corpus, max_length=setup.max_length, dtype=setup.params["dtype"],
                            sequences=len(setup.sequences), trained_window=_trained_window(setup.drafter))
    settings = FitSettings(n_ref=setup.n_ref, top_k=opts.top_k, granularity=opts.granularity,
                           estimator=opts.estimator, alpha_max=opts.alpha_max, law=opts.law, max_n=opts.max_n,
                           bootstrap=opts.bootstrap)
    if opts.stats is not None:  # the rows and what they were collected and fitted with: readers need no flags
        meta = record_meta(collection, settings)
        _write(f"--stats {opts.stats}", lambda: stats.save(opts.stats, **meta), "then --resume to finish")
    try:
        fitted, fit, notes = fit_spec(stats, collection, settings)
    except UserError as err:
        raise UserError(f"{err}; {_refit_hint(opts)}") from None
    setup.notes.extend(notes)
    spec = _selected(fitted, setup) if opts.select else fitted
    _write(f"--out {opts.out}", lambda: spec.save(opts.out), "then --resume to finish")
    return spec, fitted, fit, stats


def _selected(fitted: ScaleSpec, setup: _Setup) -> ScaleSpec:
    """``--select``: the winning deployment (``calibrate.select``), as the file to write."""
    from .select import deployed, select

    chosen, record = select(setup.drafter, setup.sequences, fitted, n_ref=setup.n_ref, max_length=setup.max_length,
                            longest=MAX_N_PER_N_REF * setup.n_ref, states=setup.states)
    setup.states.clear()
    return deployed(fitted, chosen, record)


def _refit_hint(opts: CalibrateOptions) -> str:
    """What a run whose fit failed keeps, and how to fit it again without collecting."""
    folder = partial_dir(opts.out)
    if opts.stats is None:
        return (f"the collected sequences stay in {folder}: rerun with --resume and another --n-ref or --top-k "
                "to fit them without collecting again, or delete the folder")
    return (f"the rows are saved in --stats {opts.stats}: fit them again with `sharpdraft fit {opts.stats} "
            f"--out {opts.out} --n-ref N`, or rerun with --resume and another --top-k (its n_ref is kept)")


def _trained_window(drafter) -> int | None:
    """The largest distance the drafter was trained on: the distance its training record states, else its
    training length, when it states one."""
    distance = getattr(getattr(drafter, "training", None), "distance", None)
    if distance:
        return int(distance) + 1  # W counts keys: distances 1 .. W - 1 past the query's own key
    try:
        return int(drafter.default_n_ref)
    except (UserError, AttributeError, TypeError):  # no trustworthy training length: W falls back to n_ref
        return None


def check_options(opts: CalibrateOptions) -> None:
    """Every option that can be checked without the model, before any work (and before any file is made)."""
    if opts.sequences < 1:
        raise UserError(f"--sequences {opts.sequences}: need at least 1")
    for option, value in (("--drafter-path", opts.drafter_path), ("--target-path", opts.target_path)):
        if value is not None and not str(value).strip():
            raise UserError(f"{option} is empty: give a checkpoint folder, a .gguf file or a hub id, or leave it out")
    if opts.n_ref is not None and not GRID_N_MIN <= opts.n_ref <= MAX_N:
        raise UserError(f"--n-ref {opts.n_ref}: expected {GRID_N_MIN} (the shortest sampled length) to 2^32")
    check_fit_options(top_k=opts.top_k, granularity=opts.granularity, estimator=opts.estimator,
                      alpha_max=opts.alpha_max, law=opts.law, max_n=opts.max_n, n_ref=opts.n_ref)
    if opts.max_length is not None and opts.max_length < 2 * GRID_N_MIN:
        raise UserError(f"--max-length {opts.max_length}: need at least {2 * GRID_N_MIN} tokens")
    if opts.chunk is not None and opts.chunk < 1:
        raise UserError(f"--chunk {opts.chunk}: need at least 1 query row per chunk")
    if opts.max_length is not None and opts.n_ref is not None and opts.n_ref >= opts.max_length:
        raise UserError(f"--n-ref {opts.n_ref} >= --max-length {opts.max_length}: no rows beyond n_ref to fit; "
                        f"use --max-length {4 * opts.n_ref} or a smaller --n-ref")
    if opts.bootstrap < 0:
        raise UserError(f"bootstrap {opts.bootstrap}: need at least 0 resamples")
    if opts.select:
        kind = drafter_kind(opts.drafter)
        if not kind.evaluates:
            raise UserError(f"--select: the {opts.drafter} drafter has no teacher-forced pass to measure candidates "
                            "with yet; drop --select (the fitted spec is written) and compare deployments by hand")
        if kind.causal_lm and opts.target_path is None and not cut_from_smollm2(opts.drafter_path):
            raise UserError(f"--select with --drafter {opts.drafter}: give --target-path, the target the candidates' "
                            "agreement is measured against (only a drafter cut from SmolLM2 by scripts/train_pard.py "
                            "has a default: SmolLM2)")
    # --top-k against the lengths known before loading: --n-ref, the built-in drafter's, or --max-length
    # (n_ref lies below it); a checkpoint's own n_ref is checked as soon as it is read (_prepare)
    builtin = SMOLLM2_N_REF if opts.drafter == "hf" and opts.drafter_path is None else None
    if opts.n_ref is not None or builtin is not None:
        _check_top_k(opts.top_k, opts.n_ref or builtin, "--n-ref" if opts.n_ref else "the built-in drafter's n_ref")
    elif opts.max_length is not None and _first_sampled_n(opts.top_k) >= opts.max_length:
        raise UserError(f"--top-k {opts.top_k}: too large for --max-length {opts.max_length}: rows are sampled from "
                        f"n = {_first_sampled_n(opts.top_k)} (twice the top logits kept), and the fit needs rows up "
                        "to n_ref, below --max-length; use a --top-k of at most half the n_ref")
    check_outputs({"--out": Path(opts.out), "--stats": opts.stats},
                  local_inputs(corpus=opts.corpus, drafter_path=opts.drafter_path, target_path=opts.target_path))
    check_corpus(opts.corpus, opts.max_length, drafter=opts.drafter, drafter_path=opts.drafter_path,
                 target_path=opts.target_path)


def _first_sampled_n(top_k: int) -> int:
    """The shortest visible-key count sampled: every row must see more keys than the ``k_max`` top
    logits it keeps (``RowCollector``), here at least twice as many."""
    return max(GRID_N_MIN, 2 * max(DEFAULT_K_MAX, top_k))


def _check_top_k(top_k: int, n_ref: int, source: str) -> None:
    """``--top-k`` leaves rows in the reference bucket ``(n_ref / 2, n_ref]`` that every fit reads."""
    if _first_sampled_n(top_k) > n_ref:
        raise UserError(f"--top-k {top_k}: too large for n_ref {n_ref} ({source}): rows are sampled from "
                        f"n = {_first_sampled_n(top_k)} (twice the top logits kept), and the fit needs rows up to "
                        f"n_ref; use --top-k {n_ref // 2} or less")


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
        check_params(folder, params)
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
