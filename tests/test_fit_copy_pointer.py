"""``scripts/fit_copy_pointer.py``: a copy pointer's grid fit on training text, written beside its head.

A tiny random target and head stand in for SmolLM2 and its heads: the fit runs end to end, writes a
pointer folder that loads its head, picks the grid point its rule names, and refuses bad arguments
in one line.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from calibrate.drafters.pointer import CopyPointer, read
from calibrate.training import pointer as fit

from tiny_checkpoints import tiny_target, write_tiny_dflash, write_tiny_eagle3

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from test_calibrate import _write_tokenizer

    root = tmp_path_factory.mktemp("fit")
    target = tiny_target(0)
    target.save_pretrained(root / "target")
    _write_tokenizer(root / "target")
    write_tiny_eagle3(root / "head", target, seed=1)
    write_tiny_dflash(root / "dflash", target, seed=2, block_size=4)
    words = "the query sees more keys as the context grows and a drafter copies what it read before".split()
    (root / "corpus.txt").write_text(" ".join(words[i % len(words)] * (1 + i % 3) for i in range(900)))
    return root


def test_the_fit_writes_the_best_point_beside_its_head(tiny):
    out = tiny / "copy"
    corpus = str(tiny / "corpus.txt")
    assert fit.main([str(tiny / "head"), "--out", str(out), "--target-path", str(tiny / "target"),
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


def test_a_masked_fit_writes_a_masked_pointer(tiny):
    out = tiny / "masked"
    corpus = str(tiny / "corpus.txt")
    assert fit.main([str(tiny / "head"), "--out", str(out), "--target-path", str(tiny / "target"), "--corpora",
                     corpus, "--sequences", "1", "--length", "64", "--orders", "2", "--scales", "4", "--sinks", "1",
                     "--gains", "1", "--unmatched", "masked"]) == 0
    pointer, _ = read(out)
    assert pointer in (CopyPointer(2, 4.0, 4.0, 1.0, "masked"), CopyPointer(1, 1.0, 0.0, 0.0, "masked"))  # or alone
    assert json.loads((out / "copy_pointer.json").read_text())["fitted"]["unmatched"] == "masked"


def test_a_dflash_fit_scores_blocks_by_their_accepted_length(tiny):
    """--drafter dflash: the grid is scored by a block's accepted length (leading agreements of its 3 rows), the
    record says so, and the head alone's figure is what eval's teacher-forced blocks measure on the same text."""
    from calibrate.drafters.dflash import load
    from calibrate.measure.blocks import block_anchors, block_rows

    out = tiny / "dflash-copy"
    corpus = str(tiny / "corpus.txt")
    assert fit.main([str(tiny / "dflash"), "--drafter", "dflash", "--out", str(out), "--target-path",
                        str(tiny / "target"), "--corpora", f"{corpus}", "--sequences", "2", "--length", "64",
                        "--anchors", "8", "--orders", "2", "--scales", "4", "--sinks", "1,2", "--gains", "1"]) == 0
    pointer, head = read(out)
    assert head == (tiny / "dflash").resolve()
    record = json.loads((out / "copy_pointer.json").read_text())["fitted"]
    assert record["drafter"] == "dflash" and record["anchors"] == 8 and len(record["grid"]) == 2
    rows = [record["head_alone"], *record["grid"]]  # the head alone (gain 0) can win too
    best = max(rows, key=lambda r: (r[corpus]["accepted_length"], r[corpus]["expected_accepted_length"]))
    assert CopyPointer(best["order"], best["scale"], best["sink"], best["gain"]) == pointer
    drafter = load("dflash", str(tiny / "dflash"), str(tiny / "target"), torch.device("cpu"), torch.float32)
    from calibrate.corpus import pack

    texts = list(pack(corpus, drafter.tokenize, drafter.eos_token_id, 64, 2))
    lengths, expected = [], []
    for ids in texts:  # the head alone, through eval's own block metrics
        at, _ = block_anchors(np.array([64]), 64, 3, 8)
        hits, accept = block_rows(drafter, torch.tensor([ids]), {"none": None}, at, 3)["none"]
        lengths += np.cumprod(hits, axis=1).sum(axis=1).tolist()
        expected += np.cumprod(accept, axis=1).sum(axis=1).tolist()
    alone = record["head_alone"][corpus]
    assert alone["accepted_length"] == pytest.approx(np.mean(lengths), abs=1e-4)  # rounded to 4 places
    assert alone["expected_accepted_length"] == pytest.approx(np.mean(expected), abs=1e-4) and alone[
        "expected_accepted_length"] > 0.1


def test_a_head_of_the_other_kind_is_refused_in_one_line(tiny):
    with pytest.raises(SystemExit) as err:  # a DFlash head, fitted as the default --drafter eagle3
        fit.main([str(tiny / "dflash"), "--out", str(tiny / "wrong-kind"), "--target-path", str(tiny / "target")])
    message = str(err.value)
    assert "is not an EAGLE-3 head" in message and "--drafter eagle3" in message and "\n" not in message
    assert not (tiny / "wrong-kind").exists()


@pytest.mark.parametrize("argv, fragment", [
    (["--out", "{head}"], "give a new folder"),
    (["--out", "{w}/o", "--corpora", "stdlib:heldout"], "training-split corpora"),
    (["--out", "{w}/o", "--orders", "9"], "--orders"),
    (["--out", "{w}/o", "--scales", "4,nan"], "--scales"),
    (["--out", "{w}/o", "--scales", "-1"], "a grid point is not a pointer: scale must be > 0"),
    (["--out", "{w}/o", "--gains", "2"], "gain must be from 0 to 1"),
    (["--out", "{w}/o", "--sequences", "0"], "--sequences 0"),
    (["--out", "{w}/o", "--anchors", "0"], "--anchors 0"),
    (["--out", "{w}/o", "--unmatched", "hidden"], "--unmatched hidden: give scored or masked"),
    (["--out", "{w}/o", "--unmatched", ""], "--unmatched : give scored or masked"),
    (["--out", "{w}/o", "--drafter", "hf"], "--drafter hf: give eagle3 or dflash"),
    (["--out", "{w}/o", "--drafter", ""], "--drafter : give eagle3 or dflash"),
])
def test_bad_arguments_are_refused_in_one_line(tiny, tmp_path, argv, fragment):
    argv = [a.format(head=tiny / "head", w=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as err:
        fit.parse([str(tiny / "head"), *argv])
    assert fragment in str(err.value) and "\n" not in str(err.value)
