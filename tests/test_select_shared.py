"""``calibrate --select``'s shared work held to the work it shares: the head's layers up to attention once for
every candidate, and the collection's target pass instead of one of the selection's own.

Tolerances: agreement is a count of equal argmaxes, so its gains must be equal; expected acceptance is a
float32 sum per row, summed in float64 over rows, so its gains may differ by round-off only (1e-6 absolute,
far below the 4 decimals the summary prints). The shared path computes the same operations on the same
shapes, so both are in fact equal here; the tolerance is what the test promises.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from calibrate.collect import RowCollector, log_grid
from calibrate.corpus import pack
from calibrate.drafters import load_drafter
from calibrate.drafters.eagle3 import _restriction
from calibrate.fit import MAX_N_PER_N_REF
from calibrate.measure import METRICS, NextTokenLaw, Tally, tally_sequence
from calibrate.run import CalibrateOptions, run_calibration
from calibrate.select import candidates, judge, length_edges
from calibrate.taps import ScalingTap
from sharpdraft_theory import ScaleSpec

from tiny_checkpoints import tiny_target, write_tiny_eagle3

ACCEPTANCE_TOLERANCE = 1e-6  # float32 per row, float64 over rows (module docstring)
N_REF, LENGTH, SEQUENCES = 64, 256, 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from test_calibrate import VOCAB, _write_tokenizer

    root = tmp_path_factory.mktemp("shared")
    target = tiny_target(0, vocab_size=VOCAB)
    target.save_pretrained(root / "target")
    _write_tokenizer(root / "target")
    head = write_tiny_eagle3(root / "eagle3", target, seed=1, max_position_embeddings=N_REF)
    drafter = load_drafter("eagle3", str(head), str(root / "target"), torch.device("cpu"), torch.float32)
    return {"target": str(root / "target"), "eagle3": str(head), "drafter": drafter}


def _options(tiny, out, **kw) -> CalibrateOptions:
    return CalibrateOptions(out=out, drafter="eagle3", drafter_path=tiny["eagle3"], target_path=tiny["target"],
                            max_length=LENGTH, sequences=SEQUENCES, n_ref=N_REF, device="cpu", bootstrap=50,
                            select=True, **kw)


@torch.no_grad()
def test_every_arm_of_one_pass_equals_the_whole_head_run_for_it(tiny):
    """The arms of one teacher_forced call (the head's attention inputs made once, the query copied per arm)
    against the head's own forward per spec, the target run again each time."""
    drafter = tiny["drafter"]
    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(3))
    fitted = ScaleSpec(law="log-linear", n_ref=N_REF, slope=0.3, top_k=4)
    specs = [arm.spec for arm in candidates(fitted, N_REF, 64 * N_REF) if arm.drafts == "head"]
    assert sum(s is not None and s.positions is not None for s in specs) >= 3  # the distance fixes are among them
    forced = drafter.teacher_forced(ids, [(spec, None) for spec in specs])
    head = drafter.head
    for r, spec in enumerate(specs):
        features, final = drafter.target_states(ids)
        logits = head(ids[:, 1:], features[:, :-1], attention_hook=ScalingTap(spec), **_restriction(spec)).logits[0]
        columns = head.draft_to_target(torch.arange(head.config.draft_vocab_size))
        law = NextTokenLaw(drafter.target.get_output_embeddings()(final), 1.0, columns)
        assert torch.equal(forced.drafted[r], columns[logits.argmax(-1)]), spec
        torch.testing.assert_close(forced.accept[r], law.acceptance(logits), rtol=0, atol=ACCEPTANCE_TOLERANCE)


def test_the_collection_keeps_the_target_states_teacher_forced_reads(tiny):
    """collect(keep_states=True) returns target_states of the text, and collects the same rows as without."""
    drafter = tiny["drafter"]
    ids = torch.randint(0, 256, (1, LENGTH), generator=torch.Generator().manual_seed(4))
    grid = log_grid(LENGTH)
    rows = []
    for keep in (False, True):
        collector = RowCollector(grid)
        collector.start(0)
        kept = drafter.collect(ids, collector, torch.as_tensor(grid - 1), **({"keep_states": True} if keep else {}))
        rows.append(collector.take())
    assert kept is not None
    for got, want in zip(kept, drafter.target_states(ids)):
        assert torch.equal(got, want)
    for field in ("top", "lse", "tilted_mean", "mean", "var", "n"):
        assert np.array_equal(getattr(rows[0], field), getattr(rows[1], field)), field


def _leaves(tree: dict, path: tuple = ()) -> dict:
    """A nested record's values by their path of keys: {("spec", "gain", "agreement"): [mean, lo, hi], ...}."""
    if not isinstance(tree, dict):
        return {path: tree}
    return {p: v for key, sub in tree.items() for p, v in _leaves(sub, path + (key,)).items()}


def _one_run_per_candidate(drafter, sequences, arms, edges) -> list[Tally]:
    """Per sequence, each candidate in a teacher-forced pass of its own beside none (the target and the whole
    head run again for every candidate, every arm's top-k mass measured), joined into one tally."""
    tallies = []
    for ids in sequences:
        ids = torch.tensor([ids])
        pairs = [tally_sequence(drafter, ids, [arms[0], arm], edges, top_k=4) for arm in arms[1:]]
        sums = {arms[0].name: pairs[0].sums[arms[0].name], **{a.name: p.sums[a.name] for a, p in zip(arms[1:], pairs)}}
        tallies.append(Tally(rows=pairs[0].rows, sums=sums, mass={}))
    return tallies


def test_the_selection_on_shared_passes_equals_one_run_per_candidate(tiny, tmp_path, monkeypatch):
    """calibrate --select (states kept by the collection, the head's attention inputs shared, no mass measured)
    against one pass per candidate: the same choice, reason and best, agreement gains equal, acceptance gains
    within ACCEPTANCE_TOLERANCE. A run that keeps no states (its budget 0) selects the same."""
    import calibrate.select as select_module

    kept = []
    shared_select = select_module.select

    def spy(*args, states=None, **kw):
        kept.append(dict(states or {}))
        return shared_select(*args, states=states, **kw)

    monkeypatch.setattr(select_module, "select", spy)
    drafter = tiny["drafter"]
    shared = run_calibration(_options(tiny, tmp_path / "shared.json"), drafter=drafter)
    assert sorted(kept[0]) == list(range(SEQUENCES))  # every sequence's target pass came from the collection
    monkeypatch.setattr("calibrate.run.KEEP_STATES_BYTES", 0)
    unkept = run_calibration(_options(tiny, tmp_path / "unkept.json"), drafter=drafter)
    assert kept[1] == {}
    for record in (shared.selection, unkept.selection):
        record.pop("seconds")
    assert shared.selection == unkept.selection

    sequences = list(pack("pydoc", drafter.tokenize, drafter.eos_token_id, LENGTH, limit=SEQUENCES))
    arms = candidates(shared.fitted, N_REF, MAX_N_PER_N_REF * N_REF)
    edges = length_edges(N_REF, LENGTH)
    slow = judge(_one_run_per_candidate(drafter, sequences, arms, edges), arms, edges, N_REF)
    fast = shared.selection
    assert (fast["chosen"], fast["reason"], fast["best"]) == (slow["chosen"], slow["reason"], slow["best"])
    got, want = _leaves(fast["candidates"]), _leaves(slow["candidates"])
    assert got.keys() == want.keys()
    for path, value in got.items():
        if "expected_acceptance" in path:
            assert value == pytest.approx(want[path], abs=ACCEPTANCE_TOLERANCE), path
        else:  # agreement gains, the differences from the best (in agreement), the deployments
            assert value == want[path], path
    assert {m for cell in fast["candidates"].values() for m in cell.get("gain", {})} == set(METRICS)
