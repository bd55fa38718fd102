"""Markdown tables of a ``sharpdraft eval --out`` result, as the README shows them.

    python scripts/eval_table.py out/table/eval.json > out/table/table.md
    python scripts/eval_table.py out/table/eval.json --at 8192 --versus window

Without ``--at``: one table per metric (acceptance length, when the eval ran ``--speculative``;
teacher-forced agreement; top-k mass), a row per bucket of context length, a column per variant,
each cell the value and, for every variant but ``none``, its paired difference from ``none`` with
the 95% bootstrap interval over sequences. A difference whose interval excludes 0 is in bold.

With ``--at N``: one table for the bucket ``N``, a row per variant, each metric's value, its
difference from ``none`` and from the ``--versus`` variant(s), each paired over the same rows and
sequences (the per-sequence sums eval keeps, resampled as eval resamples them).

With ``--against OTHER.json`` (another drafter's eval on the same corpus, lengths and sequences): a row
per bucket and variant both hold, each metric for this drafter, the other, and their difference paired
over the same rows and prompts (two drafters, or two trainings of one, compared as eval compares variants).

With ``--control MASKED.json`` (the same eval with ``--pointer-unmatched masked``; this one the pointer as
shipped): per bucket, the copy pointer control's four contrasts, each paired over the same rows and sequences:
the spec on each pointer (spec - none), the scaled pointer against the masked one unscaled (spec here - none
there: does the scale beat masking?) and masking alone (none here - none there).

With ``--by-output METRIC`` (an eval on a generated corpus, ``--corpus generated:NAME``): a row per bin of the
output's position, the share of its rows a 3-gram lookup drafts right (how much the text repeats itself),
``none``'s METRIC and every other variant's paired difference from it.

On a recall corpus (``--corpus recall:SOURCE``) agreement on the copied tokens and on the other rows
join the metrics (paired over those rows: the bucket's ``copy_rows_per_sequence`` and
``other_rows_per_sequence``), and one more table gives the target's own accuracy on both.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from sharpdraft_theory.bootstrap import paired_bootstrap

TITLES = {"acceptance_length": "acceptance length", "agreement": "agreement",
          "expected_acceptance": "expected acceptance", "mass": "mass", "copy_agreement": "copy agreement",
          "other_agreement": "other agreement"}
SUBSETS = ("copy", "other")  # a recall corpus's row subsets (calibrate.measure.SUBSETS)


def _delta(triple, bracket: bool = True) -> str:
    if not triple or triple[0] is None:
        return ""
    mean, lo, hi = triple
    if lo is None:
        return f" ({mean:+.3f})" if bracket else f"{mean:+.3f}"
    text = f"{mean:+.3f} [{lo:+.3f}, {hi:+.3f}]"
    if lo > 0 or hi < 0:
        text = f"**{text}**"
    return f" ({text})" if bracket else text


def contrast(bucket: dict, variant: str, versus: str, metric: str, other: dict | None = None) -> list[float] | None:
    """``[mean, lo, hi]``: ``variant`` minus ``versus`` in ``metric`` at one bucket, paired over the same
    rows (acceptance length: the same prompts), 95% bootstrap over sequences; None without per-sequence sums.
    ``other``: the bucket ``versus`` is read from (another drafter's), else ``bucket``. Where ``other``'s rows
    of a sequence are not these (a block drafter's anchors against a chain's), the difference is that of
    the per-sequence rates, each sequence weighing the same."""
    try:
        a = np.asarray(bucket[variant]["per_sequence"][metric], dtype=float)
        b = np.asarray((bucket if other is None else other)[versus]["per_sequence"][metric], dtype=float)
    except KeyError:
        return None
    if metric == "acceptance_length":  # one number a prompt
        return paired_bootstrap(a - b, None)
    subset = metric.partition("_")[0]
    rows_key = f"{subset}_rows_per_sequence" if subset in SUBSETS else "rows_per_sequence"  # the rows it sums over
    rows = np.asarray(bucket[rows_key], dtype=float)
    there = rows if other is None else np.asarray(other[rows_key], dtype=float)
    if np.array_equal(rows, there):
        return paired_bootstrap(a - b, rows)
    if (rows <= 0).any() or (there <= 0).any():  # a sequence without such rows on one side has no rate
        return None
    return paired_bootstrap(a / rows - b / there, None)  # other rows of the same sequences: their rates, paired


def _variants(bucket: dict) -> list[str]:
    return [v for v in bucket if isinstance(bucket[v], dict) and v != "target"]  # target: not a drafter


def tables(result: dict) -> str:
    buckets = result["buckets"]
    variants = _variants(buckets[0])
    metrics = [("acceptance_length", "acceptance length (tokens per target forward)")] if result["speculative"] else []
    metrics += [("agreement", "teacher-forced top-1 agreement")]
    if "target" in buckets[0]:
        metrics += [("copy_agreement", "agreement on copied tokens"),
                    ("other_agreement", "agreement on the other rows")]
    metrics += [("mass", f"top-{result['top_k']} attention mass")]
    lines = [f"{result['sequences']} sequences of {result['sequence_length']} tokens of {result['corpus']}; "
             f"drafter n_ref = {result['drafter']['n_ref']}; in brackets: difference from none, 95% interval "
             "over sequences (bold: excludes 0)", ""]
    for key, title in metrics:
        lines += [f"**{title}**", "", "| n | " + " | ".join(variants) + " |", "|---:|" + "---:|" * len(variants)]
        for row in buckets:
            cells = []
            for v in variants:
                cell = row[v]
                value = cell.get(key)
                text = "" if value is None else f"{value:.3f}"
                if v != "none" and key != "mass":
                    text += _delta(cell.get("delta_vs_none", {}).get(key))
                cells.append(text)
            lines.append(f"| {row['n']} | " + " | ".join(cells) + " |")
        lines.append("")
    if "target" in buckets[0]:
        lines += ["**the target's own accuracy on the true text**", "", "| n | copied tokens | other rows |",
                  "|---:|---:|---:|"]
        lines += [f"| {row['n']} | " + " | ".join(_number(row["target"].get(f"{s}_accuracy")) for s in SUBSETS) + " |"
                  for row in buckets]
        lines.append("")
    return "\n".join(lines)


def output_table(result: dict, metric: str = "expected_acceptance") -> str:
    """An eval on a generated corpus by output position (its ``output_bins``): a row per bin, its copy rows, none's
    ``metric`` and every other variant's paired difference from none (95% over sequences; bold: excludes 0)."""
    if not result.get("output_bins"):
        raise SystemExit("--by-output: this eval has no output bins; run it on a generated corpus "
                         "(--corpus generated:NAME)")
    bins = result["output_bins"]["bins"]
    paired = sorted(bins[0]["none"].get("per_sequence", {}))  # the metrics eval keeps per sequence, to pair
    if metric not in paired:
        raise SystemExit(f"--by-output {metric}: not a metric of this eval's output bins; give one of "
                         f"{', '.join(paired)}")
    others = [v for v in _variants(bins[0]) if v != "none"]
    lines = [f"{TITLES.get(metric, metric)} by output position, {bins[0]['sequences']} sequences of "
             f"{result['corpus']}; copy rows: the share a 3-gram lookup drafts right; paired difference from none, "
             "95% interval over sequences (bold: excludes 0)", "",
             "| output bin | copy rows | none | " + " | ".join(f"{v} - none" for v in others) + " |",
             "|---|---:|---:|" + "---:|" * len(others)]
    for b in bins:
        cells = [_delta(contrast(b, v, "none", metric), bracket=False) for v in others]
        lines.append(f"| {b['start']}-{b['end']} | {b['copy_rows_share'][0]:.2f} | {b['none'][metric]:.3f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _number(value) -> str:
    return "" if value is None else f"{value:.3f}"


def table_at(result: dict, n: int, versus: list[str]) -> str:
    """One bucket: a row per variant, each metric with its paired differences from none and ``versus``."""
    bucket = next((b for b in result["buckets"] if b["n"] == n), None)
    if bucket is None:
        raise SystemExit(f"--at {n}: the eval has buckets {[b['n'] for b in result['buckets']]}")
    variants = _variants(bucket)
    for v in versus:
        if v not in variants:
            raise SystemExit(f"--versus {v}: the eval has variants {', '.join(variants)}")
    metrics = [m for m in ("agreement", "copy_agreement", "other_agreement", "expected_acceptance", "acceptance_length")
               if bucket["none"].get(m) is not None]
    against = ["none", *[v for v in versus if v != "none"]]
    head = ["variant"] + [f"{TITLES[m]}{'' if a is None else f' - {a}'}" for m in metrics for a in (None, *against)]
    lines = [f"n = {n:,}: {result['sequences']} sequences of {result['corpus']}; drafter n_ref = "
             f"{result['drafter']['n_ref']}; differences paired, 95% interval over sequences (bold: excludes 0)", "",
             "| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for v in variants:
        cells = [v]
        for m in metrics:
            value = bucket[v].get(m)
            cells.append("" if value is None else f"{value:.3f}")
            cells += ["" if a == v else _delta(contrast(bucket, v, a, m), bracket=False) for a in against]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def same_rows(result: dict, other: dict) -> bool:
    """Refuse, in one line, two evals not over the same prompts and buckets; whether their per-sequence sums
    are over the same rows too (False for two drafters that place their rows differently, e.g. a block
    drafter's anchors against a chain's)."""
    for key in ("corpus", "sequences", "sequence_length", "skip"):
        if result.get(key) != other.get(key):
            raise SystemExit(f"--against: {key} {other.get(key)!r} there, {result.get(key)!r} here; compare evals "
                             "of the same prompts")
    if [b["n"] for b in result["buckets"]] != [b["n"] for b in other["buckets"]]:
        raise SystemExit("--against: its buckets differ from these; compare evals of the same prompts and lengths")
    return all(a.get("rows_per_sequence") == b.get("rows_per_sequence")
               for a, b in zip(result["buckets"], other["buckets"]))


def table_against(result: dict, other: dict, names: tuple[str, str]) -> str:
    """A row per bucket and shared variant: each metric here, there, and here - there, paired over sequences."""
    rows_too = same_rows(result, other)
    mine, theirs = names
    lines = [f"{result['sequences']} sequences of {result['corpus']}; {mine} against {theirs} on the same prompts; "
             "differences paired, 95% interval over sequences (bold: excludes 0)"
             + ("" if rows_too else "; the two read other rows of each sequence, so a teacher-forced difference is "
                "the mean over sequences of the difference of their rates"), ""]
    first = result["buckets"][0]
    variants = [v for v in _variants(first) if v in other["buckets"][0]]
    metrics = [m for m in ("agreement", "copy_agreement", "other_agreement", "expected_acceptance", "acceptance_length")
               if first["none"].get(m) is not None]
    head = ["n", "variant"] + [f"{TITLES[m]}{tail}" for m in metrics for tail in (f" ({mine})", f" ({theirs})",
                                                                                   f" {mine} - {theirs}")]
    lines += ["| " + " | ".join(head) + " |", "|---:|---|" + "---:|" * (len(head) - 2)]
    for here, there in zip(result["buckets"], other["buckets"]):
        for v in variants:
            cells = [f"{here['n']}", v]
            for m in metrics:
                cells += [_number(here[v].get(m)), _number(there[v].get(m)),
                          _delta(contrast(here, v, v, m, there), bracket=False)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _pointer_rule(result: dict) -> str:
    """How a result's copy pointer counted rows matching nothing ("scored", "masked"); refused without one."""
    pointer = (result.get("drafter") or {}).get("copy_pointer")
    if not isinstance(pointer, dict):
        raise SystemExit("--control: both evals must be of a drafter with a copy pointer (their drafter records "
                         "no copy_pointer)")
    return pointer.get("unmatched", "scored")


def table_control(result: dict, other: dict) -> str:
    """The copy pointer control: ``result`` the pointer that scores rows matching nothing, ``other`` the same
    numbers with them masked (``--pointer-unmatched masked``), both with ``none`` and ``spec``. A row per bucket
    and contrast (module docstring), each metric's paired difference with its 95% interval over sequences."""
    rules = _pointer_rule(result), _pointer_rule(other)
    if rules != ("scored", "masked"):
        raise SystemExit(f"--control: this eval's pointer is {rules[0]} and the other's {rules[1]}; give the scored "
                         "pointer's eval first and the masked one's (--pointer-unmatched masked) to --control")
    mine = {k: v for k, v in result["drafter"]["copy_pointer"].items() if k != "unmatched"}
    theirs = {k: v for k, v in other["drafter"]["copy_pointer"].items() if k != "unmatched"}
    if mine != theirs:
        raise SystemExit(f"--control: the pointers' numbers differ ({mine} here, {theirs} there); the control keeps "
                         "them and masks the rows matching nothing only")
    for r in (result, other):
        if not all(v in r["buckets"][0] for v in ("none", "spec")):
            raise SystemExit("--control: both evals need the variants none and spec")
    rows_too = same_rows(result, other)
    first = result["buckets"][0]
    metrics = [m for m in ("agreement", "copy_agreement", "expected_acceptance", "acceptance_length")
               if first["none"].get(m) is not None]
    contrasts = (("scored pointer: spec - none", "spec", "none", "here"),
                 ("masked pointer: spec - none", "spec", "none", "there"),
                 ("**scored + spec - masked, none**", "spec", "none", "across"),
                 ("scored, none - masked, none", "none", "none", "across"))
    lines = [f"{result['sequences']} sequences of {result['corpus']}; the copy pointer as shipped (scored) against "
             "its rows matching nothing masked, on the same prompts; differences paired, 95% interval over sequences "
             "(bold: excludes 0)" + ("" if rows_too else "; other rows of each sequence: differences of rates"), ""]
    head = ["n", "contrast"] + [TITLES[m] for m in metrics]
    lines += ["| " + " | ".join(head) + " |", "|---:|---|" + "---:|" * len(metrics)]
    for here, there in zip(result["buckets"], other["buckets"]):
        for label, variant, versus, where in contrasts:
            a, b = {"here": (here, None), "there": (there, None), "across": (here, there)}[where]
            cells = [f"{here['n']}", label] + [_delta(contrast(a, variant, versus, m, b), bracket=False) for m in metrics]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def read_result(path: Path, option: str) -> dict:
    """An eval --out file, or one line naming ``option``'s bad value and what to give."""
    try:
        result = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SystemExit(f"{option} {path}: cannot read it as JSON ({err.__class__.__name__}); give an eval --out "
                         "file") from None
    if not isinstance(result, dict) or not isinstance(result.get("buckets"), list) or not result["buckets"]:
        raise SystemExit(f"{option} {path}: not an eval result (no buckets); give an eval --out file")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("eval_json", type=Path, help="an eval --out file")
    ap.add_argument("--at", type=int, help="one table for this bucket n, a row per variant")
    ap.add_argument("--versus", default="", help="with --at: comma-separated variants to pair every variant against "
                                                 "besides none")
    ap.add_argument("--by-output", metavar="METRIC", help="an eval on a generated corpus: METRIC (agreement, "
                                                          "expected_acceptance) by output position")
    ap.add_argument("--against", type=Path, help="another drafter's eval --out file over the same prompts: "
                                                 "this one's metrics, that one's and the paired differences")
    ap.add_argument("--control", type=Path, help="the same eval with --pointer-unmatched masked (this one the "
                                                 "pointer as shipped): the copy pointer control's paired contrasts")
    args = ap.parse_args()
    result = read_result(args.eval_json, "eval_json")
    if args.control is not None:
        print(table_control(result, read_result(args.control, "--control")))
    elif args.by_output is not None:
        print(output_table(result, args.by_output))
    elif args.against is not None:
        other = read_result(args.against, "--against")
        print(table_against(result, other, (args.eval_json.stem, args.against.stem)))
    elif args.at is None:
        print(tables(result))
    else:
        print(table_at(result, args.at, [v for v in args.versus.split(",") if v]))


if __name__ == "__main__":
    main()
