"""The tables ``sharpdraft eval`` prints: a line on the run, a table per metric, the blocks' and the costs'.

Each reads the result (docs/eval.md) alone, so a saved result prints the same (:func:`print_summary`).
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ..numbers import fixed, signed_triple

__all__ = ["print_summary", "print_output_bins", "spec_label", "summary_tables", "block_table", "cost_table"]


def print_summary(result: dict) -> None:
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
    if result.get("output_bins"):
        print_output_bins(result, console)
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
                      + "; draft ms per round: the drafter's time per target forward, draft share: its part of "
                        "the decode time")


def print_output_bins(result: dict, console: Console) -> None:
    """A generated corpus's report by output position: each arm's agreement, expected acceptance and copy share
    per bin (``result["output_bins"]``), and a line on what the bins and copy rows are."""
    binned = result["output_bins"]
    rows = [{**row, "n": f"{row['start']}-{row['end']}"} for row in binned["bins"]]
    for table in summary_tables(result, console.width, buckets=rows, axis="output position", column="out",
                                only=("agreement", "expected_acceptance", "copy_share")):
        console.print(table)
    shares = ", ".join(f"{row['n']}: {fixed(row['copy_rows_share'][0])} ({row['sequences']} seq.)"
                       for row in rows if row.get("copy_rows_share"))
    console.print(f"output position: row t of a sequence is at t - its prompt's length (rows in the prompt are in no "
                  f"bin), bins of {binned['bin_size']} tokens; copy rows: the token a "
                  f"{result['generated']['copy_order']}-gram lookup over the text before it drafts right; copy share: "
                  f"of the rows an arm (or the target) gets right, the copy rows' share; copy rows per bin: {shares}")


def _half_note(result: dict) -> str:
    """Why greedy outputs can differ under half-precision weights, and the way to an exact comparison."""
    dtype = (result.get("weights") or {}).get("dtype")
    if dtype not in ("bfloat16", "float16"):
        return ""
    return (f" ({dtype} weights: the target's verification of several rows at once and its one-row decoding can "
            "round differently and turn a near-tie; --dtype float32 compares exactly)")


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


def summary_tables(result: dict, width: int = 80, *, buckets: list[dict] | None = None, axis: str = "context length n",
                   column: str = "n", only: tuple[str, ...] | None = None) -> list[Table]:
    """One table per metric of ``result`` (``calibrate.eval.run.evaluate``), each fitting ``width`` columns.

    The metrics are the numbers in the buckets' cells (mass, agreement, acceptance_length, ...; ``only``: those
    of them), the variants those of ``result["variants"]``, whatever they are. A metric with paired deltas gets
    a row per (n, variant): its value, the delta from none with its interval on one line, and the share
    of the reference's gain it recovers when there is one. A metric without gets a row per variant and a
    column per n (or, when that is too wide, a row per (n, variant)). ``buckets`` (default ``result["buckets"]``)
    are the rows, each labelled by its ``"n"``, titled by ``axis`` and headed ``column``.
    """
    from ..measure import TARGET

    buckets, variants = result["buckets"] if buckets is None else buckets, list(result["variants"])
    variants += [TARGET] if any(TARGET in row for row in buckets) else []  # the target's accuracy (recall corpus)
    metrics = list(dict.fromkeys(key for row in buckets for variant in variants if variant in row
                                 for key, value in row[variant].items()
                                 if not key.endswith("_interval") and not isinstance(value, (dict, list))
                                 and (only is None or key in only)))
    name_width = max(map(len, variants))  # variant names are never cut or folded
    tables = []
    for metric in metrics:
        label = metric.replace("_", " ")
        having = [v for v in variants if any(metric in row.get(v, {}) for row in buckets)]
        cells = [(row["n"], variant, row[variant]) for row in buckets for variant in having if variant in row]
        deltas = any((c.get("delta_vs_none") or {}).get(metric) is not None for _, _, c in cells)
        shares = any((c.get("recovered") or {}).get(metric) is not None for _, _, c in cells)
        if not deltas and 14 + 9 * len(buckets) <= width:  # variants down, lengths across
            table = Table(title=f"{label} by {axis}")
            table.add_column("variant", min_width=name_width, overflow="fold")
            for row in buckets:
                table.add_column(f"{column}={row['n']}", justify="right", no_wrap=True)
            for variant in having:
                table.add_row(variant, *(fixed(row[variant].get(metric)) if variant in row else "-"
                                         for row in buckets))
            tables.append(table)
            continue
        table = Table(title=f"{label} by {axis}" + (", Δ from none [95%]" if deltas else ""))
        table.add_column(column, justify="right", no_wrap=True)
        table.add_column("variant", min_width=name_width, overflow="fold")
        table.add_column(label, justify="right", overflow="fold")
        if deltas:
            table.add_column("Δ [95%]", justify="right", no_wrap=True)
        if shares:
            table.add_column("recovered", justify="right", no_wrap=True)  # share of the reference's gain
        for i, (n, variant, cell) in enumerate(cells):
            first, last = i == 0 or cells[i - 1][0] != n, i == len(cells) - 1 or cells[i + 1][0] != n
            values = [fixed(cell.get(metric))]
            if deltas:
                values.append(signed_triple((cell.get("delta_vs_none") or {}).get(metric)))
            if shares:
                values.append(fixed((cell.get("recovered") or {}).get(metric)))
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
            cells.append(f"{fixed(c['expected_accepted_length'])} {signed_triple(delta)}".strip()
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
