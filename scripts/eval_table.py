"""Markdown tables of a ``sharpdraft eval --json`` result, as the README shows them.

    python scripts/eval_table.py out/table/eval.json > out/table/table.md

One table per metric (acceptance length, when the eval ran ``--speculative``; teacher-forced
agreement; top-k mass): a row per bucket of context length, a column per variant, each cell the
value and, for every variant but ``none``, its paired difference from ``none`` with the 95%
bootstrap interval over sequences. A difference whose interval excludes 0 is in bold.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _delta(triple) -> str:
    if not triple or triple[0] is None:
        return ""
    mean, lo, hi = triple
    if lo is None:
        return f" ({mean:+.3f})"
    text = f"{mean:+.3f} [{lo:+.3f}, {hi:+.3f}]"
    return f" (**{text}**)" if lo > 0 or hi < 0 else f" ({text})"


def tables(result: dict) -> str:
    buckets = result["buckets"]
    variants = [v for v in buckets[0] if isinstance(buckets[0][v], dict)]
    metrics = [("acceptance_length", "acceptance length (tokens per target forward)")] if result["speculative"] else []
    metrics += [("agreement", "teacher-forced top-1 agreement"), ("mass", f"top-{result['top_k']} attention mass")]
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
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python scripts/eval_table.py EVAL.json")
    print(tables(json.loads(Path(sys.argv[1]).read_text())))


if __name__ == "__main__":
    main()
