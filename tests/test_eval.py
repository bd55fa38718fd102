"""``sharpdraft eval`` on tiny random drafters: structure, no change at n <= n_ref, exact mass scaling."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.drafters.eagle3 import Eagle3Drafter, load_eagle3_head
from calibrate.drafters.hf import CausalLMDrafter
from calibrate.errors import UserError
from calibrate.eval_cmd import plot_result
from calibrate.evaluate import MassMeter, bucket_edges, default_spec, evaluate
from calibrate.taps import ScalingTap
from sharpdraft_theory import ScaleSpec

from tiny_checkpoints import tiny_target, write_tiny_eagle3

LENGTHS = [32, 64, 128]  # the tiny head's n_ref is 64


class ByteTokenizer:
    """Bytes as token ids (vocabulary 256), 0 as end of sequence."""

    eos_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return [b or 1 for b in text.encode()]

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": self.encode(text)}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run faster on one thread than on two busy ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = random.Random(0)
    words = ["query", "key", "mass", "attention", "drafter", "token", "the", "of", "a", "long", "context"]
    path = tmp_path_factory.mktemp("corpus") / "heldout.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(200)))
    return str(path)


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory):
    target = tiny_target(0)
    head = load_eagle3_head(write_tiny_eagle3(tmp_path_factory.mktemp("eagle3"), target, seed=1), target)
    return Eagle3Drafter(head, target, ByteTokenizer())


SPEC = ScaleSpec(law="log-linear", n_ref=64, slope=0.5, top_k=2)


@pytest.fixture(scope="module")
def eagle3_result(eagle3, corpus):
    return evaluate(eagle3, spec=SPEC, lengths=LENGTHS, corpus=corpus, sequences=2,
                    rows_per_bucket=16, speculative=True, new_tokens=8, num_draft=3)


def test_eagle3_result_shape(eagle3_result):
    r = eagle3_result
    assert [b["n"] for b in r["buckets"]] == LENGTHS
    assert r["speculative"]["outputs_identical"] is True
    assert r["drafter"]["n_ref"] == 64
    for row in r["buckets"]:
        for variant in ("none", "spec", "qwen-logn"):
            cell = row[variant]
            assert 0 < cell["mass"] <= 1 and 0 <= cell["agreement"] <= 1
            assert 1 <= cell["acceptance_length"] <= 4 and cell["speedup"] > 0
    json.dumps(r)  # JSON-ready


def test_no_change_at_or_below_n_ref(eagle3_result):
    """alpha = 1 for n <= n_ref under both laws: mass and agreement are those of the plain drafter."""
    for row in eagle3_result["buckets"][:2]:
        for variant in ("spec", "qwen-logn"):
            assert row[variant]["mass"] == row["none"]["mass"]
            assert row[variant]["agreement"] == row["none"]["agreement"]
    last = eagle3_result["buckets"][-1]
    assert last["spec"]["mass"] > last["none"]["mass"]  # sharper queries, more mass on the top keys


def test_scaling_tap_shows_the_meter_the_scaled_query():
    """Through ScalingTap the meter measures alpha(n) q, alpha from the theory's float64 law."""
    g = torch.Generator().manual_seed(0)
    query, key = torch.randn(1, 4, 100, 8, generator=g), torch.randn(1, 2, 100, 8, generator=g)
    n_visible = torch.arange(1, 101)[None]
    spec = ScaleSpec(law="log-linear", n_ref=16, slope=0.7, top_k=2)
    edges = bucket_edges([16, 64, 100])
    tapped, manual, plain = (MassMeter(edges, 2, rows_per_bucket=10) for _ in range(3))
    tap = ScalingTap(spec, tapped)
    tap(0, query.clone(), key, 0.35, n_visible)
    alpha = torch.as_tensor(spec.alpha(n_visible[0].numpy()), dtype=torch.float32)
    manual(0, query * alpha[None, None, :, None], key, 0.35, n_visible)
    plain(0, query, key, 0.35, n_visible)
    t, m, p = tapped.result(), manual.result(), plain.result()
    # the same float32 product up to the last ulp of alpha (torch's log against numpy's)
    np.testing.assert_allclose([t[b] for b in t], [m[b] for b in m], rtol=1e-5)
    assert t[0] == p[0] and t[2] > p[2]  # alpha = 1 up to n_ref = 16, sharper beyond: this test can fail
    assert torch.equal(tap.n_visible, n_visible)


def test_causal_lm_drafter(corpus):
    target = tiny_target(0)
    drafter = CausalLMDrafter(tiny_target(3), ByteTokenizer(), kind="hf", path="tiny", default_n_ref=64,
                              target=target)
    r = evaluate(drafter, spec=SPEC, lengths=LENGTHS, corpus=corpus, sequences=1, rows_per_bucket=8,
                 speculative=True, new_tokens=6, num_draft=2)
    assert r["speculative"]["outputs_identical"] is True
    first = r["buckets"][0]
    for variant in ("spec", "qwen-logn"):
        for key in ("mass", "agreement", "acceptance_length"):  # speedup is a timing
            assert first[variant][key] == first["none"][key]


def test_default_spec():
    s = default_spec(256, 4)
    assert (s.law, s.n_ref, s.slope, s.top_k) == ("log-linear", 256, 0.2, 4)


def test_plot(eagle3_result, tmp_path):
    plot_result(eagle3_result, tmp_path / "eval.png")
    assert (tmp_path / "eval.png").stat().st_size > 1000


@pytest.mark.parametrize("args, message", [
    (["--lengths", "256,abc"], "comma-separated integers"),
    (["--lengths", "1"], ">= 2"),
    (["--plot", "out.pdf"], "give a .png"),
    (["--drafter", "dflash"], "--drafter dflash: eval supports hf, pard, eagle3"),
    (["--drafter", "medusa"], "--drafter medusa: expected one of hf, pard, eagle3, dflash"),
])
def test_cli_user_errors(args, message):
    result = CliRunner().invoke(app, ["eval", *args])
    assert isinstance(result.exception, UserError)
    assert message in str(result.exception)


def test_skip_past_the_corpus(eagle3, corpus):
    with pytest.raises(UserError, match="--skip 50"):
        evaluate(eagle3, spec=SPEC, lengths=LENGTHS, corpus=corpus, sequences=1, skip=50)
