"""The results shipped in ``benchmarks/results/`` say what docs/results.md quotes from them.

Each online-adaptation run (``online-*.json.gz``, a ``sharpdraft bench`` result) must stand in the docs as
``scripts/bench_table.py --summary`` prints it, row by row, in the section that compares the arms end to end.

Each copy pointer control is a pair of eval results (the pointer as shipped, and with
``--pointer-unmatched masked``); ``scripts/eval_table.py SCORED --control MASKED`` prints its contrasts, and
every contrast at 8,192 (the figure, its interval, in the table's own format) must stand in the section
the docs give it. The bootstrap is seeded, so the strings are exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from calibrate.bench_tables import read_result, summary
from calibrate.eval.tables import table_control

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAIRS = sorted(p.name.removesuffix("-scored.json") for p in RESULTS.glob("control-*-scored.json"))
ONLINE = sorted(RESULTS.glob("online-*.json.gz"))
ONLINE_SECTION = "### End to end on the three workloads (4,096 tokens)"


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_every_control_pair_is_shipped_whole():
    assert PAIRS, "no control results shipped"
    for name in PAIRS:
        assert (RESULTS / f"{name}-masked.json").is_file(), name


@pytest.mark.parametrize("name", PAIRS)
def test_the_docs_quote_each_control_as_its_results_give_it(name):
    scored = json.loads((RESULTS / f"{name}-scored.json").read_text())
    masked = json.loads((RESULTS / f"{name}-masked.json").read_text())
    table = table_control(scored, masked)
    rows = [line for line in table.splitlines() if line.startswith("| 8192 |")]
    assert len(rows) == 4, table
    docs = _section((ROOT / "docs" / "results.md").read_text(), "### The control: a pointer that scores no unmatched key")
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        label, figures = cells[1], cells[2:]
        quoted = [line for line in docs.splitlines() if line.startswith(f"| {label} |")]
        assert any(all(f in line for f in figures) for line in quoted), (name, label, figures)


def test_online_runs_are_shipped():
    assert len(ONLINE) >= 5, [p.name for p in ONLINE]  # EAGLE-3 and DFlash on the workloads the docs table holds


@pytest.mark.parametrize("path", ONLINE, ids=lambda p: p.name)
def test_the_docs_quote_each_online_run_as_its_result_gives_it(path):
    docs = _section((ROOT / "docs" / "results.md").read_text(), ONLINE_SECTION)
    rows = summary([read_result(path)]).splitlines()[2:]
    assert rows
    for row in rows:
        assert row in docs, row
