"""Markdown tables of ``sharpdraft bench --out`` results, as docs/results.md shows them.

    python scripts/bench_table.py o-diary-eagle3.json o-diary-dflash.json > table.md

One table per result, a row per arm: the acceptance length (tokens per target forward) in each bin of
output position (pooled over the prompts that reach the bin; their count in the header; with two or
more prompts there, the 95% interval over them), over the whole output, the speedup over target-only
per prompt and its geometric mean, the arm's speed over ``none``'s (the geometric mean over prompts of
``none``'s decode time over the arm's: greedy arms decode the same text, so this is paired), and, where
an online arm ran, the seconds spent learning (inside the decode time) with their share, the peak
memory over ``none``'s and the state held beyond the drafter. A last column says whether every greedy
output equalled target-only.

    python scripts/bench_table.py --summary o-*.json > summary.md

``--summary``: one table over several results, a row per result and arm (workload, drafter, arm): the
acceptance length in the first and last bins and over the whole output, the fade (last bin over first,
its interval over the prompts that reach the last bin), the speedup's geometric mean, the speed over
``none``'s, the state held and the peak over ``none``'s; the arms of a run are compared within its rows.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from .measure.longgen import geometric_mean

__all__ = ["markdown", "summary", "read_result", "same_as_target"]


def _interval(t, digits: int = 2) -> str:
    if t is None:
        return "-"
    text = f"{t[0]:.{digits}f}"
    return text if t[1] is None else f"{text} [{t[1]:.{digits}f}, {t[2]:.{digits}f}]"


def _mib(n) -> str:
    return "" if n is None else f"{n / 2**20:+.1f}" if n < 0 else f"{n / 2**20:.1f}"


def same_as_target(arm: dict) -> str:
    """Whether every greedy output of ``arm`` equalled target-only: yes, NO, or - (sampled: nothing to claim)."""
    return "-" if arm["identical"] is None else "yes" if arm["identical"] else "NO"


def _folder(result: dict) -> str:
    return Path(result["drafter"].get("path") or "default").name


def over_none(result: dict, arm: str) -> list[float | None] | None:
    """``[geometric mean, lo, hi]`` over prompts of ``none``'s decode seconds per token over ``arm``'s (above 1:
    the arm is faster), paired on each prompt; None without a ``none`` arm."""
    if "none" not in result["arms"]:
        return None

    def per_token(run):
        return run["decode_seconds"] / max(run["decode_tokens"], 1)

    return geometric_mean([per_token(u["arms"]["none"]) / per_token(u["arms"][arm]) for u in result["units"]])


def markdown(result: dict) -> str:
    """One markdown table of a bench result (the module's docstring says what each column holds)."""
    arms = result["arms"]
    first = next(iter(arms.values()))
    counts = first.get("prompts_by_bin") or [None] * len(result["bins"])
    learning = any(arm.get("updates") for arm in arms.values())
    head = [f"{lo}-{hi} ({n})" if n is not None else f"{lo}-{hi}" for (lo, hi), n in zip(result["bins"], counts)]
    head += ["whole", "speedup per prompt", "geomean", "over none"]
    if learning:
        head += ["updates s (share)", "peak over none MiB", "extra MiB"]
    head.append("= target")
    lines = ["| arm | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for name, arm in arms.items():
        cells = [_interval(t) for t in arm["acceptance_by_bin"]]
        cells.append(f"{arm['acceptance_length']:.2f}")
        cells.append(" / ".join(f"{s:.2f}" for s in arm["speedup_per_prompt"]))
        cells.append(_interval(arm["speedup_geomean"]))
        cells.append("" if name == "none" or "none" not in arms else _interval(over_none(result, name)))
        if learning:
            extra = arm.get("extra_bytes")
            cells.append(f"{arm['update_seconds']:.1f} ({100 * (arm['update_share'] or 0):.1f}%)"
                         if arm.get("updates") else "")
            cells.append("" if name == "none" else _mib(arm.get("peak_memory_over_none")))
            cells.append(_mib(extra and extra["total"]))
        cells.append(same_as_target(arm))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    prompts = ", ".join(f"{p['id']} {p['output_tokens']}" for p in result["prompts"])
    title = (f"{result['workload']['name']}, {result['drafter']['kind']} ({_folder(result)}),"
             f" {len(result['prompts'])} prompts (output tokens: {prompts}); target only "
             f"{result['target']['tokens_per_second']} tokens/s")
    return f"{title}\n\n" + "\n".join(lines)


def summary(results: list[dict]) -> str:
    """One markdown table over ``results``, a row per result and arm (the module's docstring, ``--summary``)."""
    head = ["workload", "drafter", "arm", "first bin", "last bin", "whole", "fade", "speedup (geomean)",
            "over none", "extra MiB", "peak over none MiB", "= target"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for result in results:
        outputs = "/".join(str(p["output_tokens"]) for p in result["prompts"])
        for name, arm in result["arms"].items():
            cells = [f"{result['workload']['name']} ({outputs})", f"{result['drafter']['kind']} ({_folder(result)})", name,
                     _interval(arm["acceptance_by_bin"][0]), _interval(arm["acceptance_by_bin"][-1]),
                     f"{arm['acceptance_length']:.2f}", _interval(arm.get("fade")),
                     _interval(arm["speedup_geomean"]),
                     "" if name == "none" or "none" not in result["arms"] else _interval(over_none(result, name)),
                     _mib((arm.get("extra_bytes") or {}).get("total", 0)),
                     "" if name == "none" else _mib(arm.get("peak_memory_over_none")),
                     same_as_target(arm)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def read_result(path: Path) -> dict:
    """A bench --out file (or its gzip, ``.json.gz``, as benchmarks/results ships them), or one line naming it
    and what to give."""
    try:
        opened = gzip.open(path, "rt", encoding="utf-8") if path.name.endswith(".gz") else path.open(encoding="utf-8")
        with opened as f:
            result = json.load(f)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SystemExit(f"{path}: cannot read it as JSON ({err.__class__.__name__}); give a bench --out file") from None
    if not isinstance(result, dict) or result.get("schema") != "sharpdraft.bench/v1":
        raise SystemExit(f"{path}: not a bench result (schema sharpdraft.bench/v1); give a bench --out file")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench_json", type=Path, nargs="+", help="bench --out files")
    ap.add_argument("--summary", action="store_true",
                    help="one table over the files, a row per file and arm (first and last bins, whole, fade, speed)")
    args = ap.parse_args()
    results = [read_result(p) for p in args.bench_json]  # every file checked before any table prints
    print(summary(results) if args.summary else "\n\n".join(markdown(r) for r in results))
