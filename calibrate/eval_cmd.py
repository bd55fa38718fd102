"""``sharpdraft eval``: a thin typer command over ``calibrate.evaluate.evaluate``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from .drafters import drafter_kind, kind_names
from .errors import UserError
from .numbers import fixed as _number, signed_triple as _delta
from .speculative import ASSISTED_LOOP

__all__ = ["eval_command", "plot_result", "summary_tables", "cost_table"]

err_console = Console(stderr=True)

MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 100.0  # below, softmax(logits / T) is greedy in float32; above, all but uniform
MAX_SEED = 2**63 - 1  # seeds are numpy SeedSequence entropy; a bound keeps a typo from passing as a seed


def _lengths(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--lengths {text}: expected comma-separated integers, e.g. 256,512,1024,2048") from None
    if not values or min(values) < 2:
        raise UserError(f"--lengths {text}: expected context lengths >= 2, e.g. 256,512,1024,2048")
    return values


def _variants(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def check_temperature(value: float) -> float:
    """``--temperature``: finite, from :data:`MIN_TEMPERATURE` to :data:`MAX_TEMPERATURE`; else a ``UserError``."""
    if not (math.isfinite(value) and MIN_TEMPERATURE <= value <= MAX_TEMPERATURE):
        raise UserError(f"--temperature {value}: expected a temperature from {MIN_TEMPERATURE:g} to "
                        f"{MAX_TEMPERATURE:g} (default 1.0, the model's own distribution; greedy agreement is "
                        "reported besides)")
    return float(value)


def check_seed(value: int) -> int:
    """``--seed``: an integer from 0 to :data:`MAX_SEED`; else a ``UserError``."""
    if not 0 <= value <= MAX_SEED:
        raise UserError(f"--seed {value}: expected an integer from 0 to {MAX_SEED}")
    return int(value)


def check_lookup(max_ngram: int, min_ngram: int):
    """``--lookup-max-ngram`` and ``--lookup-min-ngram`` as ``calibrate.lookup.LookupSettings``; else a ``UserError``."""
    from .lookup import MAX_NGRAM, LookupSettings

    for option, value in (("--lookup-max-ngram", max_ngram), ("--lookup-min-ngram", min_ngram)):
        if not 1 <= value <= MAX_NGRAM:
            raise UserError(f"{option} {value}: expected an n-gram length from 1 to {MAX_NGRAM}")
    if min_ngram > max_ngram:
        raise UserError(f"--lookup-min-ngram {min_ngram}: must be at most --lookup-max-ngram {max_ngram}")
    return LookupSettings(max_ngram=max_ngram, min_ngram=min_ngram)


def eval_command(
    *,
    drafter: Annotated[str, typer.Option(help=f"Drafter kind: {', '.join(kind_names(evaluates=True))}.")] = "eagle3",
    drafter_path: Annotated[Optional[str], typer.Option(
        "--drafter-path", help="Drafter checkpoint (default: the built-in SmolLM2 drafters for eagle3, dflash and pard), or a "
                               "folder with a copy_pointer.json naming one (e.g. calibrate/assets/eagle3-smollm2-copy).")] = None,
    target_path: Annotated[Optional[str], typer.Option(
        "--target-path", help="Target model folder (default: built-in SmolLM2).")] = None,
    spec: Annotated[Optional[Path], typer.Option(help="Scale spec JSON to evaluate (default: log-linear, slope 0.2, "
                                                 "at the drafter's n_ref).")] = None,
    extra_spec: Annotated[Optional[list[str]], typer.Option(
        "--extra-spec", help="Another spec measured on the same passes, as NAME=FILE (repeatable; the variant "
                             "spec:NAME): e.g. --extra-spec layer=spec-layer.json --extra-spec head=spec-head.json "
                             "pairs per-layer and per-head specs with the global --spec on one target pass.")] = None,
    lengths: Annotated[str, typer.Option(help="Context-length bucket edges; the largest is the sequence length.")]
        = "256,512,1024,2048",
    corpus: Annotated[str, typer.Option(help="Held-out text: pydoc:heldout, stdlib:heldout, a .txt or .jsonl file, "
                                        "or a folder; recall:SOURCE (e.g. recall:stdlib:heldout) for SOURCE's text "
                                        "with passages repeated at set distances, reporting copy agreement.")]
        = "pydoc:heldout",
    sequences: Annotated[Optional[int], typer.Option(help="At most this many sequences of the largest length "
                                                     "(default: all the corpus holds).")] = None,
    skip: Annotated[int, typer.Option(help="Sequences of the corpus to pass over first.")] = 0,
    top_k: Annotated[Optional[int], typer.Option("--top-k", help="Top set size for the mass (default: the spec's).")]
        = None,
    speculative: Annotated[bool, typer.Option("--speculative", help="Also run speculative decoding (greedy unless "
                                              "--sample): acceptance length and speedup.")] = False,
    sample: Annotated[bool, typer.Option("--sample", help="With --speculative: speculative sampling at --temperature "
                                         "(rejection-sampling verification; the output follows the target's "
                                         "distribution) instead of greedy decoding.")] = False,
    seed: Annotated[Optional[int], typer.Option(help="With --sample: the random seed (default 0); each prompt's runs "
                                                "draw from a stream seeded by it and the prompt, the same for every "
                                                "variant.")] = None,
    new_tokens: Annotated[int, typer.Option("--new-tokens", help="Tokens generated per speculative prompt.")] = 32,
    num_draft: Annotated[Optional[int], typer.Option(
        "--num-draft", help="Drafts per verification K (default: 4 for chains; block size - 1 for dflash).")] = None,
    variants: Annotated[str, typer.Option(help="Variants to compare, comma-separated: none, spec, qwen-logn, window, "
                                          "sinks, clamp, group, pi, clamp+spec, group+spec, pi+spec, lookup "
                                          "(prompt lookup), lookup+head (lookup, else the drafter), reference, "
                                          "online-full, online-lora, online-full+spec, online-lora+spec "
                                          "(none is always run; lookup too on a recall corpus).")]
        = "none,spec,qwen-logn,window,sinks",
    lookup_max_ngram: Annotated[int, typer.Option(
        "--lookup-max-ngram", help="The lookup variants' longest suffix matched against the context "
                                   "(transformers' max_matching_ngram_size, default 2).")] = 2,
    lookup_min_ngram: Annotated[int, typer.Option(
        "--lookup-min-ngram", help="The lookup variants' shortest suffix matched (default 1).")] = 1,
    window: Annotated[Optional[int], typer.Option(help="The window variant's W: the drafter attends to its last W "
                                                  "keys (default: its n_ref).")] = None,
    sinks: Annotated[int, typer.Option(help="The sinks variant's S: the first S keys plus the last W - S.")] = 4,
    neighbour_window: Annotated[Optional[int], typer.Option(
        "--neighbour-window", help="W of the clamp and group variants: the last W keys keep their positions "
                                   "(default: n_ref - 1 for clamp, n_ref // 2 for group; below n_ref).")] = None,
    group: Annotated[Optional[int], typer.Option(
        "--group", help="G of the group variants (Self-Extend's group size; default: the least G >= 2 that keeps "
                        "every grouped distance below n_ref up to the longest length).")] = None,
    n_ref: Annotated[Optional[int], typer.Option(
        "--n-ref", help="The drafter's training length: where qwen-logn starts, the window's default W and the "
                        "default spec's n_ref (default: the drafter's, from its training record or config; a "
                        "checkpoint's max_position_embeddings can be its target's context, not its training "
                        "length).")] = None,
    reference_drafter_path: Annotated[Optional[str], typer.Option(
        "--reference-drafter-path", help="Another head of the same kind (e.g. long-trained), run unscaled as the "
                                         "variant 'reference'.")] = None,
    temperature: Annotated[float, typer.Option(
        help="Temperature T, 0.01 to 100: of the expected acceptance sum_x min(p_T, q_T) (the chance "
             "speculative sampling at T accepts a drafted token, reported beside greedy agreement), and of the "
             "draws with --sample.")] = 1.0,
    slopes: Annotated[Optional[str], typer.Option(
        help="Oracle: log-linear slopes to try on the same rows, comma-separated (e.g. 0.05,0.1,0.2,0.4); "
             "teacher-forced only, ranked by agreement gain past n_ref.")] = None,
    alphas: Annotated[Optional[str], typer.Option(
        help="Oracle: constant query scales past n_ref to try (e.g. 0.9,1.1,1.25), as --slopes.")] = None,
    online_every: Annotated[Optional[int], typer.Option(
        "--online-every", help="Online arms: rows per chunk M; each chunk is scored, then learnt from "
                               "(default 64).")] = None,
    online_steps: Annotated[Optional[int], typer.Option(
        "--online-steps", help="Online arms: AdamW steps G on each chunk after it is scored (default 1).")] = None,
    online_lr: Annotated[Optional[float], typer.Option(
        "--online-lr", help="Online arms: AdamW learning rate (default 1e-4 for online-full, 1e-3 for "
                            "online-lora).")] = None,
    online_rank: Annotated[Optional[int], typer.Option(
        "--online-rank", help="online-lora: rank r of the update B A of each attention and MLP projection "
                              "(default 8).")] = None,
    online_carry: Annotated[bool, typer.Option(
        "--online-carry", help="Online arms: keep the learnt weights from one sequence to the next (default: "
                               "each sequence starts from the checkpoint).")] = False,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Continue an interrupted run: finished sequences and prompts are kept in <out>.partial "
                         "and read back (needs --out and the same options).")] = False,
    device: Annotated[str, typer.Option(help="auto (CUDA when present), cpu or cuda.")] = "auto",
    dtype: Annotated[str, typer.Option(help="Weights: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16.")]
        = "auto",
    threads: Annotated[int, typer.Option(help="CPU threads for torch (0: torch's default). On a busy machine 1 is "
                                         "often fastest: decoding one token is too little work to share.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
    out: Annotated[Optional[Path], typer.Option(help="Also write the JSON result here (atomically).")] = None,
    plot: Annotated[Optional[Path], typer.Option(help="Save mass and agreement versus n as a PNG here.")] = None,
):
    """Mass, agreement and (with --speculative) acceptance per context length, per variant, with paired intervals."""
    import torch

    from sharpdraft_theory.atomic import atomic_write_text

    from .drafters import load_drafter, resolve_device, resolve_dtype
    from .evaluate import (LOOKUP_VARIANTS, bucket_edges, check_lookup_loop, check_variants,
                           default_spec, evaluate, parse_extra_specs, with_lookup)
    from .measure import SavedUnits, parse_grid, partial_dir
    from .online import online_options
    from .preflight import check_corpus, check_outputs, load_spec, local_inputs

    drafter_kind(drafter, evaluates=True)
    edges = _lengths(lengths)
    bucket_edges(edges)
    names = _variants(variants)
    if reference_drafter_path is not None and "reference" not in names:
        names.append("reference")  # the reference head is a variant once given
    chosen = check_variants(names, window=window, sinks=sinks, has_reference=reference_drafter_path is not None,
                            neighbour_window=neighbour_window, group=group, n_ref=n_ref, longest=max(edges))
    if reference_drafter_path is not None and not Path(reference_drafter_path).exists() and drafter == "eagle3":
        raise UserError(f"--reference-drafter-path {reference_drafter_path}: no such folder")
    if sequences is not None and sequences < 1:
        raise UserError(f"--sequences {sequences}: expected at least 1 (default: every held-out sequence)")
    for option, value, least in (("--threads", threads, 0), ("--skip", skip, 0), ("--num-draft", num_draft, 1),
                                 ("--new-tokens", new_tokens, 2)):
        if value is not None and value < least:
            raise UserError(f"{option} {value}: need at least {least}")
    if top_k is not None and top_k < 1:
        raise UserError(f"--top-k {top_k}: need at least 1 (or leave it out for the spec's)")
    online = online_options(chosen, kind=drafter, every=online_every, steps=online_steps, lr=online_lr,
                            rank=online_rank, carry=online_carry, speculative=speculative, resume=resume)
    temperature = check_temperature(temperature)
    if seed is not None and not sample:
        raise UserError(f"--seed {seed}: seeds the draws of --sample only, and greedy decoding draws nothing; add "
                        "--speculative --sample, or drop --seed")
    seed = check_seed(0 if seed is None else seed)
    if sample and not speculative:
        raise UserError("--sample: samples in speculative decoding; add --speculative")
    if n_ref is not None and not 2 <= n_ref < edges[-1]:
        raise UserError(f"--n-ref {n_ref}: expected at least 2 and below the largest of --lengths ({edges[-1]}), "
                        "so that some bucket lies beyond it")
    slope_grid, alpha_grid = parse_grid("--slopes", slopes), parse_grid("--alphas", alphas)
    if plot is not None and plot.suffix.lower() != ".png":
        raise UserError(f"--plot {plot}: give a .png file name")
    extra_files = parse_extra_specs(extra_spec)
    check_outputs({"--out": out, "--plot": plot},
                  {**local_inputs(spec=spec, corpus=corpus, drafter_path=drafter_path, target_path=target_path,
                                  reference_drafter_path=reference_drafter_path),
                   **{f"--extra-spec {name.removeprefix('spec:')}": path for name, file in extra_files.items()
                      for path in local_inputs(file=file).values()}})
    lookup = check_lookup(lookup_max_ngram, lookup_min_ngram)
    check_lookup_loop(drafter, with_lookup(chosen, corpus), speculative)
    check_corpus(corpus, max(edges))
    loaded_spec = load_spec(spec) if spec is not None else None
    k = top_k or (loaded_spec.top_k if loaded_spec else 4)
    if loaded_spec is not None:
        loaded_spec = _at_top_k(loaded_spec, k, f"--spec {spec}")
    extras = {name: _at_top_k(load_spec(file), k, f"--extra-spec {name.removeprefix('spec:')}={file}")
              for name, file in extra_files.items()}
    if n_ref is not None:  # the grid's specs are checked before loading when n_ref is known
        from .measure import scale_grid
        scale_grid(slope_grid, alpha_grid, n_ref, k)
    params = {"drafter": drafter, "drafter_path": drafter_path, "target_path": target_path,
              "spec": loaded_spec.to_dict() if loaded_spec else None, "lengths": sorted(set(edges)), "corpus": corpus,
              "sequences": sequences, "skip": skip, "top_k": k, "speculative": speculative, "new_tokens": new_tokens,
              "num_draft": num_draft, "variants": list(chosen), "window": window, "sinks": sinks, "n_ref": n_ref,
              "reference_drafter_path": reference_drafter_path, "temperature": temperature, "slopes": slope_grid,
              "alphas": alpha_grid, "dtype": dtype, "neighbour_window": neighbour_window, "group": group,
              "sample": sample, "seed": seed,
              "lookup": lookup.to_dict() if set(LOOKUP_VARIANTS) & set(with_lookup(chosen, corpus)) else None,
              "online": None if online is None else online.to_dict(),
              "extra_specs": {name: extra.to_dict() for name, extra in extras.items()} or None}
    saved = SavedUnits(None if out is None else partial_dir(out), params, resume)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if threads:
        torch.set_num_threads(threads)
    with torch.inference_mode() if online is None else torch.no_grad():  # online arms learn: autograd on
        d = load_drafter(drafter, drafter_path, target_path, dev, dt)
        ref = None if reference_drafter_path is None else load_drafter(drafter, reference_drafter_path, target_path,
                                                                       dev, dt)
        n_ref = d.default_n_ref if n_ref is None else n_ref
        if loaded_spec is None:
            loaded_spec = default_spec(n_ref, k)
        _check_on_drafter(loaded_spec, d, drafter, n_ref, f"--spec {spec}")
        for name, extra in extras.items():
            _check_on_drafter(extra, d, drafter, n_ref, f"--extra-spec {name.removeprefix('spec:')}={extra_files[name]}")
        progress = None if as_json else (lambda msg: err_console.print(f"[dim]{msg}[/]"))
        result = evaluate(d, spec=loaded_spec, lengths=edges, corpus=corpus, sequences=sequences, skip=skip,
                          speculative=speculative, new_tokens=new_tokens, num_draft=num_draft, variants=chosen,
                          window=window, sinks=sinks, reference=ref, progress=progress, n_ref=n_ref,
                          temperature=temperature, slopes=slope_grid, alphas=alpha_grid, saved=saved,
                          neighbour_window=neighbour_window, group=group, sample=sample, seed=seed, lookup=lookup,
                          online=online, extra_specs=extras)
    result["weights"] = {"device": dev.type, "dtype": str(dt).removeprefix("torch.")}
    result["spec_file"] = str(spec) if spec is not None else None
    result["extra_spec_files"] = {name: str(file) for name, file in extra_files.items()} or None
    text = json.dumps(result, indent=2)
    try:
        if out is not None:
            atomic_write_text(out, text + "\n")
        if plot is not None:
            plot_result(result, plot)
    except OSError as err:
        raise UserError(f"cannot write {err.filename or out}: {err.strerror}; the evaluation was not saved"
                        + ("; --resume reads back what was measured" if out is not None else "")) from None
    saved.finish()
    if as_json:
        print(text)
        return
    _table(result)


def _half_note(result: dict) -> str:
    """Why greedy outputs can differ under half-precision weights, and the way to an exact comparison."""
    dtype = (result.get("weights") or {}).get("dtype")
    if dtype not in ("bfloat16", "float16"):
        return ""
    return (f" ({dtype} weights: the target's verification of several rows at once and its one-row decoding can "
            "round differently and turn a near-tie; --dtype float32 compares exactly)")


def _at_top_k(spec, k: int, label: str):
    """``spec`` with top-k ``k`` (the run's: every variant's mass is read at one k)."""
    from sharpdraft_theory import ScaleSpec, SpecError

    if spec.top_k == k:
        return spec
    try:
        return ScaleSpec.from_dict({**spec.to_dict(), "top_k": k})
    except SpecError as err:
        raise UserError(f"--top-k {k}: does not fit {label} ({err})") from None


def _check_on_drafter(spec, d, kind: str, n_ref: int, label: str) -> None:
    """A spec file against the loaded drafter: its layers and heads, and a fix's window below n_ref."""
    from sharpdraft_theory import SpecError

    try:
        spec.check_fits(d.info.num_layers, d.info.num_heads, what=f"the {kind} drafter")
    except SpecError as err:
        raise UserError(f"{label}: {err}") from None
    fix = spec.positions
    if fix is not None and fix.window is not None and fix.window >= n_ref:
        raise UserError(f"{label}: positions.window {fix.window} must be below the drafter's n_ref ({n_ref}), "
                        "as --neighbour-window: past n_ref a distance is itself untrained; write a smaller "
                        "window, or pass --n-ref if the drafter's training length is larger")


def _table(result: dict) -> None:
    """Print the summary: one line on the run, then one table per metric (``summary_tables``)."""
    console = Console()  # made here, so it reads COLUMNS at print time (80 in a pipe)
    v = result["variants"]
    spec = v.get("spec")
    console.print(f"[bold]{result['drafter']['kind']}[/] drafter, n_ref = {result['drafter']['n_ref']}; "
                  f"{result['sequences']} sequence(s) x {result['sequence_length']} tokens of {result['corpus']}"
                  + (f" after {result['skip']}" if result["skip"] else "") + "; "
                  + (f"spec: {spec_label(spec)}; " if spec else "")
                  + "".join(f"{name}: {spec_label(d)}; " for name, d in v.items() if name.startswith("spec:") and d)
                  + f"top-{result['top_k']} mass; rows whose context n_prev < n <= n; Δ: paired difference from "
                  "none, 95% bootstrap interval over sequences; every interval in --json")
    for table in summary_tables(result, console.width):
        console.print(table)
    if result.get("recall"):
        distances = ", ".join(map(str, sorted(set(result["recall"]["distances"]))))
        console.print(f"copy: rows whose token repeats the one {distances} tokens back (the recall corpus's "
                      "distances); other: the text's other rows; target: the target's own greedy token equals the "
                      "true one")
    if result.get("blocks"):
        console.print(block_table(result["blocks"]))
    if result.get("costs"):
        console.print(cost_table(result))
    unmetered = [name for name, d in v.items() if d and d.get("positions")]
    if result["drafter"]["kind"] == "dflash":
        console.print("mass -: not metered for DFlash blocks in eval (its teacher-forced pass batches many blocks "
                      "per call); sharpdraft calibrate measures it, one block at a time")
    elif unmetered:
        console.print(f"mass -: not metered for {', '.join(unmetered)} (a position fix changes the logits a "
                      "meter reads at true positions)")
    if result["speculative"] is not None:
        s = result["speculative"]
        if s["verification"] == "sampling":
            check = f"sampling at temperature {s['temperature']:g}, seed {s['seed']} (outputs are random draws)"
        else:
            check = ("outputs identical to target-only greedy decoding: "
                     + ("[green]yes[/]" if s["outputs_identical"] else "[red]NO[/]" + _half_note(result)))
        console.print(f"Speculative decoding ({s['loop']}): {s['new_tokens']} tokens per prompt, "
                      f"{s['drafting'].split(':')[0]} of {s['num_draft']}; {check}. Speedup is target-only decoding time over "
                      "speculative time on this machine: it falls below 1 where a target forward is too cheap "
                      "to save (a small target on CPU, a Python loop), even when acceptance length is near 2"
                      + ("; draft ms per round: the drafter's time per target forward, draft share: its part of "
                         "the decode time" if s["loop"] != ASSISTED_LOOP else ""))


def spec_label(d: dict) -> str:
    """A variant's deployment (``describe_spec``) in a few words: "clamp W=256 + log-linear slope 0.2472"."""
    parts = []
    if d.get("positions"):
        fix = d["positions"]
        parts.append(fix["fix"] + "".join(f" {k[0].upper()}={fix[k]}" for k in ("window", "group", "n_ref")
                                          if fix.get(k) is not None))
    if d.get("window") is not None:
        parts.append(f"window {d['window']}" + (f" + {d['sinks']} sinks" if d.get("sinks") else ""))
    slope = d.get("slope")
    if d.get("law") == "constant" and "alpha" in d:
        parts.append(f"constant alpha {d['alpha']:.4g}")
    elif slope is not None and slope != 0 or not parts:
        granular = {"layer": " (mean of one per layer)", "head": " (mean of one per head)"}.get(d.get("granularity"), "")
        parts.append(d["law"] + ("" if slope is None else f" slope {slope:.4g}{granular}"))
    return " + ".join(parts)


def summary_tables(result: dict, width: int = 80) -> list[Table]:
    """One table per metric of ``result`` (``calibrate.evaluate.evaluate``), each fitting ``width`` columns.

    The metrics are the numbers in the buckets' cells (mass, agreement, acceptance_length, ...), the
    variants those of ``result["variants"]``, whatever they are. A metric with paired deltas gets a
    row per (n, variant): its value, the delta from none with its interval on one line, and the share
    of the reference's gain it recovers when there is one. A metric without gets a row per variant and a
    column per n (or, when that is too wide, a row per (n, variant)).
    """
    from .measure import TARGET

    buckets, variants = result["buckets"], list(result["variants"])
    variants += [TARGET] if any(TARGET in row for row in buckets) else []  # the target's accuracy (recall corpus)
    metrics = list(dict.fromkeys(key for row in buckets for variant in variants if variant in row
                                 for key, value in row[variant].items()
                                 if not key.endswith("_interval") and not isinstance(value, (dict, list))))
    name_width = max(map(len, variants))  # variant names are never cut or folded
    tables = []
    for metric in metrics:
        label = metric.replace("_", " ")
        having = [v for v in variants if any(metric in row.get(v, {}) for row in buckets)]
        cells = [(row["n"], variant, row[variant]) for row in buckets for variant in having if variant in row]
        deltas = any((c.get("delta_vs_none") or {}).get(metric) is not None for _, _, c in cells)
        shares = any((c.get("recovered") or {}).get(metric) is not None for _, _, c in cells)
        if not deltas and 14 + 9 * len(buckets) <= width:  # variants down, lengths across
            table = Table(title=f"{label} by context length n")
            table.add_column("variant", min_width=name_width, overflow="fold")
            for row in buckets:
                table.add_column(f"n={row['n']}", justify="right", no_wrap=True)
            for variant in having:
                table.add_row(variant, *(_number(row[variant].get(metric)) if variant in row else "-"
                                         for row in buckets))
            tables.append(table)
            continue
        table = Table(title=f"{label} by context length n" + (", Δ from none [95%]" if deltas else ""))
        table.add_column("n", justify="right", no_wrap=True)
        table.add_column("variant", min_width=name_width, overflow="fold")
        table.add_column(label, justify="right", overflow="fold")
        if deltas:
            table.add_column("Δ [95%]", justify="right", no_wrap=True)
        if shares:
            table.add_column("recovered", justify="right", no_wrap=True)  # share of the reference's gain
        for i, (n, variant, cell) in enumerate(cells):
            first, last = i == 0 or cells[i - 1][0] != n, i == len(cells) - 1 or cells[i + 1][0] != n
            values = [_number(cell.get(metric))]
            if deltas:
                values.append(_delta((cell.get("delta_vs_none") or {}).get(metric)))
            if shares:
                values.append(_number((cell.get("recovered") or {}).get(metric)))
            table.add_row(str(n) if first else "", variant, *values, end_section=last)
        tables.append(table)
    return tables


def block_table(blocks: dict) -> Table:
    """Drafts of one forward, teacher-forced (``calibrate.measure.blocks``): the expected accepted length per
    arm and bucket with its difference from none, and agreement at the first and last draft."""
    K = blocks["draft_length"]
    table = Table(title=f"{K} drafts per forward, at {blocks['anchors_per_bucket']} anchors a bucket per sequence: "
                        f"expected accepted length (Δ from none [95%]); agreement at draft 1 / draft {K}")
    table.add_column("n", justify="right")
    names = [n for n in blocks["buckets"][0] if n not in ("n", "anchors")]
    for name in names:
        table.add_column(name, justify="right")
    for row in blocks["buckets"]:
        cells = []
        for name in names:
            c = row.get(name)
            if c is None:
                cells.append("-")
                continue
            delta = (c.get("delta_vs_none") or {}).get("expected_accepted_length")
            agree = c["agreement_by_position"]
            cells.append(f"{_number(c['expected_accepted_length'])} {_delta(delta)}".strip()
                         + f"\n{agree[0]:.3f} / {agree[-1]:.3f}")
        table.add_row(str(row["n"]), *cells)
    return table


def cost_table(result: dict) -> Table:
    """Memory and time per arm (``result["costs"]``): extra bytes beyond the drafter (exact in
    --json), the peak memory of the arm's pass and its wall time per token."""
    costs = result["costs"]
    method = next((c["peak_method"] for c in costs.values() if c["peak_method"]), None)
    table = Table(title="memory and time per arm" + (f" (peak: {method})" if method else ""))
    table.add_column("variant", min_width=max(map(len, costs)), overflow="fold")
    for label in ("extra", "peak", "ms/token", "pass"):
        table.add_column(label, justify="right", no_wrap=True)
    for name, c in costs.items():
        extra = c["extra_bytes"]
        table.add_row(name, "-" if extra is None else _bytes(extra["total"]), _bytes(c["peak_bytes"]),
                      "-" if c["seconds_per_token"] is None else f"{1000 * c['seconds_per_token']:.2f}", c["pass"])
    return table


def _bytes(n) -> str:
    if n is None:
        return "-"
    return "0 B" if n == 0 else f"{n / 2**20:.2f} MiB"


def plot_result(result: dict, path: Path) -> None:
    """Mass, agreement and (with acceptance) acceptance length versus n (log x), one line per variant,
    agreement and acceptance with their 95% bootstrap bands over sequences."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("mass", f"mean top-{result['top_k']} attention mass"), ("agreement", "teacher-forced top-1 agreement")]
    if result["speculative"] is not None:
        panels.append(("acceptance_length", "acceptance length (tokens per target forward)"))

    from .plots.style import save_figure

    n = [row["n"] for row in result["buckets"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    styles = ("o-", "s-", "^--", "v-.", "D:", "*-")
    for ax, (key, label) in zip(axes, panels):
        for variant, style in zip(result["variants"], styles):
            cells = [row[variant] for row in result["buckets"]]
            line, = ax.plot(n, [_nan(c.get(key)) for c in cells], style, label=variant)
            bands = [c.get(f"{key}_interval") for c in cells]
            if any(b is not None for b in bands):
                ax.fill_between(n, [_nan(b and b[0]) for b in bands], [_nan(b and b[1]) for b in bands],
                                color=line.get_color(), alpha=0.15, lw=0)
        ax.axvline(result["drafter"]["n_ref"], color="grey", lw=0.8, ls=":", label="n_ref")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context n (bucket upper edge)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['drafter']['kind']} drafter on {result['corpus']} ({result['sequences']} sequences; "
                 "bands: 95% bootstrap over sequences)")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)  # atomically: an interrupted run leaves no half-written PNG
    plt.close(fig)


def _nan(x):
    return float("nan") if x is None else x
