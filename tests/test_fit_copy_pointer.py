"""``scripts/fit_copy_pointer.py``: a copy pointer's grid fit on training text, written beside its head.

A tiny random target and head stand in for SmolLM2 and its heads: the fit runs end to end, writes a
pointer folder that loads its head, picks the grid point its rule names, and refuses bad arguments
in one line.
"""

from __future__ import annotations

import json

import pytest

from calibrate.drafters.pointer import CopyPointer, read

from tiny_checkpoints import load_script, tiny_target, write_tiny_eagle3

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from test_calibrate import _write_tokenizer

    root = tmp_path_factory.mktemp("fit")
    target = tiny_target(0)
    target.save_pretrained(root / "target")
    _write_tokenizer(root / "target")
    write_tiny_eagle3(root / "head", target, seed=1)
    words = "the query sees more keys as the context grows and a drafter copies what it read before".split()
    (root / "corpus.txt").write_text(" ".join(words[i % len(words)] * (1 + i % 3) for i in range(900)))
    return root


def test_the_fit_writes_the_best_point_beside_its_head(tiny):
    script = load_script("fit_copy_pointer")
    out = tiny / "copy"
    corpus = str(tiny / "corpus.txt")
    assert script.main([str(tiny / "head"), "--out", str(out), "--target-path", str(tiny / "target"),
                        "--corpora", f"recall:{corpus},{corpus}", "--sequences", "2", "--length", "96",
                        "--orders", "1,2", "--scales", "4", "--sinks", "1,2", "--gains", "1"]) == 0
    pointer, head = read(out)
    assert head == (tiny / "head").resolve()
    record = json.loads((out / "copy_pointer.json").read_text())["fitted"]
    assert record["head_alone"]["gain"] == 0.0 and len(record["grid"]) == 4
    mean = lambda row: sum(row[c]["agreement"] for c in record["corpora"]) / 2  # noqa: E731
    best = max(record["grid"], key=mean)
    assert abs(mean(best) - mean(next(r for r in record["grid"] if CopyPointer(
        r["order"], r["scale"], r["sink"], r["gain"]) == pointer))) < 1e-9


@pytest.mark.parametrize("argv, fragment", [
    (["--out", "{head}"], "give a new folder"),
    (["--out", "{w}/o", "--corpora", "stdlib:heldout"], "training-split corpora"),
    (["--out", "{w}/o", "--orders", "9"], "--orders"),
    (["--out", "{w}/o", "--scales", "4,nan"], "--scales"),
    (["--out", "{w}/o", "--scales", "-1"], "a grid point is not a pointer: scale must be > 0"),
    (["--out", "{w}/o", "--gains", "2"], "gain must be from 0 to 1"),
    (["--out", "{w}/o", "--sequences", "0"], "--sequences 0"),
])
def test_bad_arguments_are_refused_in_one_line(tiny, tmp_path, argv, fragment):
    script = load_script("fit_copy_pointer")
    argv = [a.format(head=tiny / "head", w=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as err:
        script.parse([str(tiny / "head"), *argv])
    assert fragment in str(err.value) and "\n" not in str(err.value)
