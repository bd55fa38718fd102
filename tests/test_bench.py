"""``sharpdraft bench`` on tiny checkpoints: every arm decodes the whole workload, greedy outputs equal
target-only, the by-position report adds up, and a resumed run keeps its finished prompts."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import torch

from calibrate.bench import BenchOptions, partial_dir, plot_result, report_tables, run_bench
from calibrate.bench_tables import markdown, over_none, read_result, summary
from calibrate.drafters.eagle3 import Eagle3Adapter, load_eagle3_head
from calibrate.errors import UserError
from calibrate.online import DECODING_LR

from tiny_checkpoints import tiny_target, write_tiny_eagle3

pytestmark = pytest.mark.usefixtures("one_thread")


class _Bytes:
    """Byte-level ids below 255; 255 is end-of-sequence; no chat template (a base model's tokenizer)."""

    eos_token_id = 255
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [b % 255 for b in text.encode()]}

    def encode(self, text, add_special_tokens=False):
        return self(text)["input_ids"]


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    target = tiny_target(0)
    head = load_eagle3_head(write_tiny_eagle3(tmp_path_factory.mktemp("eagle3"), target, seed=1), target)
    return Eagle3Adapter(head, target, tokenizer=_Bytes())


@pytest.fixture()
def workload(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": text, "split": "heldout"}) + "\n"
                            for i, text in enumerate(["abcabcabcabc", "the quick brown fox", "0101010101"])))
    return str(path)


def _opts(tmp_path, workload, **over):
    base = dict(out=tmp_path / "b.json", workload=workload, prompts=3, new_tokens=40, bin_size=10,
                variants=("none", "window", "lookup"), window=8)
    return BenchOptions(**(base | over))


def test_greedy_bench_reports_every_arm_by_output_position(tmp_path, workload, drafter):
    opts = _opts(tmp_path, workload)
    result = run_bench(opts, drafter=drafter)
    assert json.loads(opts.out.read_text())["arms"].keys() == {"none", "window", "lookup"}
    assert not partial_dir(opts.out).exists()
    ends = [u["target"]["tokens"] for u in result["units"]]
    assert all(0 < n <= 40 for n in ends) and any(n < 40 for n in ends)  # a stop at end-of-sequence is exercised
    assert result["bins"] == [[0, 10], [10, 20], [20, 30], [30, 40]]
    for name, arm in result["arms"].items():
        assert arm["identical"] is True, name  # greedy: every arm writes the target's own text
        runs = [u["arms"][name]["accepted"] for u in result["units"]]
        assert arm["acceptance_length"] == pytest.approx(sum(len(a) + sum(a) for a in runs) / sum(map(len, runs)),
                                                         abs=1e-4)
        assert len(arm["speedup_per_prompt"]) == 3 and arm["speedup_geomean"][0] > 0
        reached = sum(p["output_tokens"] >= 40 for p in result["prompts"])  # the others wrote end-of-sequence
        assert arm["fade_prompts"] == reached and (arm["fade"] is not None) == (reached > 0)
        assert all(1 <= t[0] <= 1 + 4 for t in arm["acceptance_by_bin"])  # K = 4 drafts at most
    by_bin, speed = report_tables(result)
    assert by_bin.row_count == 3 and speed.row_count == 3
    plot_result(result, tmp_path / "b.png")
    assert (tmp_path / "b.png").stat().st_size > 0


def test_a_minimum_length_makes_every_prompt_write_on(tmp_path, workload, drafter):
    """``min_new_tokens``: the prompts that end early without it run the whole length, every arm still
    writing target-only decoding's text; the option is part of the resume key only when set."""
    assert any(u["target"]["tokens"] < 40 for u in run_bench(_opts(tmp_path, workload), drafter=drafter)["units"])
    opts = _opts(tmp_path, workload, out=tmp_path / "m.json", min_new_tokens=40)
    result = run_bench(opts, drafter=drafter)
    assert [p["output_tokens"] for p in result["prompts"]] == [40, 40, 40]
    assert all(arm["identical"] is True for arm in result["arms"].values())
    assert result["options"]["min_new_tokens"] == 40 and "min_new_tokens" not in _opts(tmp_path, workload).to_dict()


def test_a_resumed_bench_keeps_the_finished_prompts(tmp_path, workload, drafter, monkeypatch):
    import calibrate.bench as bench

    opts = _opts(tmp_path, workload, variants=("none",), window=None)
    calls = []
    real = bench._one_prompt

    def flaky(*args):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(bench, "_one_prompt", flaky)
    with pytest.raises(KeyboardInterrupt):
        run_bench(opts, drafter=drafter)
    assert len(list(partial_dir(opts.out).glob("0000*-p*.json"))) == 2 and not opts.out.exists()
    with pytest.raises(UserError, match="pass --resume"):
        run_bench(opts, drafter=drafter)
    with pytest.raises(UserError, match="new_tokens does not match"):
        run_bench(BenchOptions(**(vars(opts) | {"resume": True, "new_tokens": 30})), drafter=drafter)
    damaged = sorted(partial_dir(opts.out).glob("0000*-p*.json"))[0]
    kept = damaged.read_text()
    damaged.write_text('{"prompt_tokens": 3}')
    with pytest.raises(UserError, match="is damaged"):
        run_bench(BenchOptions(**(vars(opts) | {"resume": True})), drafter=drafter)
    damaged.write_text(kept)
    monkeypatch.setattr(bench, "_one_prompt", real)
    calls.clear()
    result = run_bench(BenchOptions(**(vars(opts) | {"resume": True})), drafter=drafter)
    assert len(result["units"]) == 3


def test_online_arms_learn_in_the_loop_and_count_their_cost(tmp_path, workload, drafter):
    """Online arms decode the target's own text (greedy), learn in the loop (update seconds inside the decode
    time, a learner's bytes held), from the checkpoint at every prompt; frozen arms hold 0 bytes."""
    head = {k: v.clone() for k, v in drafter.head.state_dict().items()}
    opts = _opts(tmp_path, workload, variants=("none", "online-full", "online-lora+spec"), window=None,
                 online_every=8, online_lr=1e-2, online_rank=2)
    result = run_bench(opts, drafter=drafter)
    assert result["options"]["online"] == {"every": 8, "steps": 1, "lr": {"online-full": 0.01, "online-lora": 0.01},
                                           "rank": 2, "carry": False}
    for name, arm in result["arms"].items():
        assert arm["identical"] is True, name
        assert arm["peak_memory"] > 0 and arm["peak_memory_over_none"] is not None
        runs = [u["arms"][name] for u in result["units"]]
        if name == "none":
            assert arm["update_seconds"] == 0 and arm["updates"] == 0 and arm["extra_bytes"]["total"] == 0
            continue
        assert arm["updates"] == sum(r["updates"] for r in runs) > 0
        assert all(r["update_seconds"] <= r["draft_seconds"] <= r["decode_seconds"] for r in runs)
        assert 0 < arm["update_share"] < 1
        held = arm["extra_bytes"]
        assert held["total"] == held["weights"] + held["gradients"] + held["optimizer"] + held["buffer"] > 0
    full, lora = (result["arms"][n]["extra_bytes"]["weights"] for n in ("online-full", "online-lora+spec"))
    assert full > lora > 0  # a copy of the head against rank-2 factors
    assert all(torch.equal(head[k], v) for k, v in drafter.head.state_dict().items())
    assert report_tables(result)[1].row_count == 3
    rows = [line for line in markdown(result).splitlines() if line.startswith("| ")]
    assert len(rows) == 4 and "updates s (share)" in rows[0] and rows[1].startswith("| none |")
    lines = summary([result, result]).splitlines()  # a row per result and arm
    assert len(lines) == 2 + 2 * 3
    cells = [c.strip() for c in lines[3].split("|")[1:-1]]
    full = result["arms"]["online-full"]
    assert cells[2] == "online-full" and cells[5] == f"{full['acceptance_length']:.2f}"
    assert cells[8] == "{:.2f} [{:.2f}, {:.2f}]".format(*over_none(result, "online-full"))
    assert cells[9] == f"{full['extra_bytes']['total'] / 2**20:.1f}" and cells[11] == "yes"

    def per_token(run):
        return run["decode_seconds"] / run["decode_tokens"]

    paired = [per_token(u["arms"]["none"]) / per_token(u["arms"]["online-full"]) for u in result["units"]]
    assert over_none(result, "online-full")[0] == pytest.approx(np.exp(np.mean(np.log(paired))), rel=1e-12)
    assert over_none(result, "none") == [pytest.approx(1.0)] * 3


def test_bench_tables_refuse_what_is_not_a_bench_result(tmp_path):
    (tmp_path / "e.json").write_text(json.dumps({"schema": "sharpdraft.eval/v1", "buckets": []}))
    with pytest.raises(SystemExit, match="e.json: not a bench result"):
        read_result(tmp_path / "e.json")
    with pytest.raises(SystemExit, match="missing.json: cannot read it as JSON"):
        read_result(tmp_path / "missing.json")
    (tmp_path / "cut.json.gz").write_bytes(gzip.compress(b'{"schema": "sharpdraft.bench/v1"}')[:-6])
    with pytest.raises(SystemExit, match="cut.json.gz: cannot read it as JSON"):
        read_result(tmp_path / "cut.json.gz")
    (tmp_path / "plain.json.gz").write_text("{}")  # not gzip at all
    with pytest.raises(SystemExit, match="plain.json.gz: cannot read it as JSON"):
        read_result(tmp_path / "plain.json.gz")
    (tmp_path / "b.json.gz").write_bytes(gzip.compress(b'{"schema": "sharpdraft.bench/v1", "arms": {}}'))
    assert read_result(tmp_path / "b.json.gz")["arms"] == {}


def test_sampled_bench_runs_each_arm_from_a_paired_stream(tmp_path, workload, drafter):
    result = run_bench(_opts(tmp_path, workload, temperature=0.8, variants=("none", "lookup"), window=None,
                             prompts=2), drafter=drafter)
    assert all(arm["identical"] is None for arm in result["arms"].values())  # sampling: no equality to claim


def test_online_arms_learn_at_the_decoding_rates_by_default(tmp_path, workload):
    online = _opts(tmp_path, workload, variants=("none", "online-full", "online-lora"), window=None).to_dict()["online"]
    assert online["lr"] == DECODING_LR and online["every"] == 64 and online["rank"] == 8


_ONLINE = {"variants": ("none", "online-full"), "window": None}  # the rank's width: the demo head's config (192)


@pytest.mark.parametrize("over,fragment", [
    ({"new_tokens": 0}, "--new-tokens 0"),
    ({"bin_size": 0}, "--bin-size 0"),
    ({"bin_size": 41}, "--bin-size 41"),
    ({"prompts": 0}, "--prompts 0"),
    ({"prompts": 4}, "--prompts 4: w:heldout has 3"),
    ({"num_draft": 0}, "--num-draft 0"),
    ({"temperature": float("nan")}, "--temperature nan"),
    ({"temperature": 0.001}, "--temperature 0.001"),
    ({"seed": -1}, "--seed -1"),
    ({"min_new_tokens": -1}, "--min-new-tokens -1"),
    ({"min_new_tokens": 41}, "--min-new-tokens 41"),
    ({"variants": ("none", "nonsense")}, "unknown variant 'nonsense'"),
    ({"variants": ("none", "spec"), "window": None}, "--variants spec: pass --spec"),
    ({"variants": ("none", "spec"), "window": 0}, "--window 0"),
    ({"drafter": "gpt"}, "gpt"),
    (_ONLINE | {"online_lr": 0.0}, "--online-lr 0"),
    (_ONLINE | {"online_lr": -1e-3}, "--online-lr -0.001"),
    (_ONLINE | {"online_lr": float("nan")}, "--online-lr nan"),
    (_ONLINE | {"online_every": 0}, "--online-every 0"),
    (_ONLINE | {"online_steps": 0}, "--online-steps 0"),
    (_ONLINE | {"variants": ("none", "online-lora"), "online_rank": 0}, "--online-rank 0"),
    (_ONLINE | {"variants": ("none", "online-lora"), "online_rank": 200}, "--online-rank 200: above the width"),
    ({"variants": ("none", "window"), "online_lr": 1e-3}, "--online-lr: no online arm"),
    (_ONLINE | {"drafter": "hf"}, "online-full: online adaptation while decoding is for EAGLE-3, DFlash and PARD"),
    (_ONLINE | {"drafter": "pard", "variants": ("none", "online-lora"), "online_rank": 200},
     "--online-rank 200: above the width"),  # the built-in PARD model's config (192)
])
def test_bad_options_are_refused_before_any_model_loads(tmp_path, workload, over, fragment):
    with pytest.raises(UserError, match=fragment.replace("+", r"\+")):
        _opts(tmp_path, workload, **over).check()
