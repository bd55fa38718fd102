"""On the real SmolLM2-135M: the runtime restores the top-k attention mass at 4 x n_ref.

Two 1024-token forwards over Python's documentation prose, one plain and one with the runtime
on, each through a tap that records the logits ``scaling * q k^T`` the kernel sees for a few query
rows per band (every layer and head). The slope is fitted on the plain forward by mass matching
(theory.md, E1) on rows just below ``4 n_ref`` and checked on the next rows, in the scaled
forward, where every layer's input has changed too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from calibrate.smollm2 import load_smollm2
from scipy.optimize import brentq
from sharpdraft_theory import ScaleSpec, topk_mass
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import sharpdraft_runtime as sr

pytestmark = pytest.mark.slow

N_REF, TOP_K, LENGTH, ROWS = 256, 4, 1024, 12
BANDS = {"ref": N_REF, "fit": 4 * N_REF - ROWS, "far": 4 * N_REF}  # rows whose n is the last ROWS values up to this
TAP = "sharpdraft-test-tap"


@pytest.fixture(scope="module")
def smollm2():
    """(model, input ids of shape (1, LENGTH)): SmolLM2-135M-Instruct in float32 (shared, cached per process)."""
    from pydoc_data.topics import topics

    model, tokenizer = load_smollm2()
    ids = tokenizer("\n\n".join(topics.values()), return_tensors="pt").input_ids[:, :LENGTH]
    return model, ids


def tapped_logits(model, ids, runtime: bool) -> dict[str, np.ndarray]:
    """Logits the attention kernel sees, per band: (layers, heads, ROWS, LENGTH) float64, -inf where masked."""
    rows = np.concatenate([np.arange(n - ROWS, n) for n in BANDS.values()])  # query positions (n = row + 1)
    seen = []

    def tap(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        attend = sr.sharpdraft_attention if runtime else sdpa_attention_forward
        out = attend(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        # The runtime scales the query in place, so `query` is now what the kernel used.
        keys = repeat_kv(key, module.num_key_value_groups)[0]  # (heads, k_len, head_dim)
        z = scaling * (query[0, :, rows] @ keys.transpose(-1, -2)).double()  # (heads, rows, k_len)
        z.masked_fill_(torch.arange(key.shape[-2])[None, None, :] > torch.as_tensor(rows)[None, :, None], -torch.inf)
        seen.append(z.numpy())
        return out

    AttentionInterface.register(TAP, tap)
    AttentionMaskInterface.register(TAP, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(TAP)
    try:
        with torch.inference_mode():
            model(ids)
    finally:
        model.set_attn_implementation(previous)
    z = np.stack(seen)  # (layers, heads, 3 * ROWS, LENGTH)
    return {band: z[:, :, i * ROWS:(i + 1) * ROWS] for i, band in enumerate(BANDS)}


def mean_mass(z: np.ndarray, alpha=1.0) -> float:
    return float(np.mean(topk_mass(z, TOP_K, alpha)))


def test_runtime_restores_top_k_mass_at_4x_n_ref(smollm2):
    model, ids = smollm2
    plain = tapped_logits(model, ids, runtime=False)
    reference = mean_mass(plain["ref"])  # n in (n_ref - ROWS, n_ref]: the mass the drafter was trained with
    n_fit = np.arange(BANDS["fit"] - ROWS + 1, BANDS["fit"] + 1)  # (ROWS,)
    slope = brentq(lambda s: mean_mass(plain["fit"], 1 + s * np.log(n_fit / N_REF)) - reference, 0.0, 5.0)
    spec = ScaleSpec(law="log-linear", n_ref=N_REF, slope=slope, top_k=TOP_K)

    sr.enable(model, spec)
    try:
        scaled = tapped_logits(model, ids, runtime=True)
    finally:
        sr.disable(model)
    far_plain, far_scaled = mean_mass(plain["far"]), mean_mass(scaled["far"])
    report = (f"top-{TOP_K} mass: reference {reference:.4f} at n <= {N_REF}; at n ~ {BANDS['far']}: plain "
              f"{far_plain:.4f}, runtime {far_scaled:.4f} (slope {slope:.4f} fitted at n ~ {BANDS['fit']})")
    print(report)
    # Rows with n <= n_ref have alpha = 1 and only see earlier tokens: untouched, to float32 rounding.
    np.testing.assert_allclose(scaled["ref"], plain["ref"], rtol=0, atol=1e-4)
    assert far_plain < reference - 0.01, report  # the dilution is real on this model and text
    # The spec, applied by the runtime through every layer, must recover most of the lost mass.
    assert abs(far_scaled - reference) < 0.25 * (reference - far_plain), report
