"""Distance fixes (clamp, group, pi): the mapping, the runtime's remapped logits against a float64
direct computation, identity where nothing is remapped, and eval's variants equal to what a user deploys."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sharpdraft_runtime as sr
from calibrate.drafters.eagle3 import Eagle3Adapter, load_eagle3_head
from calibrate.drafters.hf import CausalLMAdapter
from calibrate.drafters.layers import RopeScaling, rope_inv_freq
from calibrate.drafters.target import hidden_state_features
from calibrate.errors import UserError
from calibrate.speculative import GREEDY
from calibrate.eval.variants import POSITION_VARIANTS, check_variants, position_fix, variant_specs
from sharpdraft_runtime import fused, positions
from sharpdraft_runtime.positions import at_slots, cos_sin, decode_keys, remapped_attention, remapped_logits, rotate
from sharpdraft_theory import ScaleSpec
from sharpdraft_theory.positions import PositionFix, default_group, max_distance, pi_exponent

from tiny_checkpoints import tiny_target, write_tiny_eagle3

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)

# float64 runtime vs float64 direct computation: logits are O(10) sums of 16 products; re-rotation by
# a shift adds a few ulps per angle (angles up to ~40 rad): 1e-11 leaves a wide margin over ~1e-14.
ATOL_LOGITS64 = 1e-11
# float32 models compared with each other on the same kernel path: identical math, different row chunks
# or cache layouts, so only summation order differs (~1e-7 on the tiny model's O(0.2) logits).
ATOL_SAME32 = 1e-5
# float32 keys (|x| < 6) rotated in float32 against float64: cos and sin rounded to float32 and two products
# and a sum, a few ulps of the largest value (~2e-6 at most); 1e-5 leaves a margin, far below a moved key.
ATOL_ROTATED32 = 1e-5
# float32 attention against float64 (40 keys, O(1) logits and values): rotation, logits, softmax and the weighted
# sum each round to float32, ~1e-6 on O(1) outputs; 1e-5 leaves a margin.
ATOL_ATTENTION32 = 1e-5

FIXES = [PositionFix("clamp", window=7), PositionFix("group", window=8, group=3), PositionFix("pi", n_ref=8)]
ROPES = [None, RopeScaling("llama3", (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                                      ("original_max_position_embeddings", 16))),
         RopeScaling("yarn", (("factor", 4.0), ("original_max_position_embeddings", 16)))]


# -- the mapping -----------------------------------------------------------------------------------------------------

def test_pi_exponent_is_the_least_power_of_two_that_fits():
    i = np.arange(0, 5000)
    k = pi_exponent(i, 256)
    assert np.all(i + 1 <= 256 * 2.0 ** k)  # every distance of the row, i at most, scaled below n_ref
    assert np.all((k == 0) | (i + 1 > 256 * 2.0 ** (k - 1)))  # and the least such k
    assert torch.equal(pi_exponent(torch.arange(5000), 256, torch), torch.as_tensor(k))  # one definition, two namespaces


@pytest.mark.parametrize("n_ref", [2, 8, 255, 256, 300])
def test_one_rows_pi_exponent_is_the_arrays(n_ref):
    """``pi_exponent`` of one row given as a plain integer (the runtime's decoding step) equals the array form's."""
    i = np.arange(0, 20000)
    want = pi_exponent(i, n_ref)
    assert [pi_exponent(int(r), n_ref) for r in i] == want.tolist()
    assert pi_exponent(np.int64(5000), n_ref) == want[5000]


@pytest.mark.parametrize("n_ref,longest", [(256, 8192), (256, 2048), (64, 1000), (16, 8192)])
def test_default_group_keeps_every_distance_in_the_trained_range(n_ref, longest):
    window = n_ref // 2
    group = default_group(n_ref, longest, window)
    assert max_distance(PositionFix("group", window=window, group=group), longest) <= n_ref - 1
    if group > 2:  # the least such G: one less goes past n_ref (this test can fail)
        assert max_distance(PositionFix("group", window=window, group=group - 1), longest) > n_ref - 1


def test_pi_and_clamp_keep_every_distance_in_the_trained_range():
    assert max_distance(PositionFix("pi", n_ref=64), 4096) < 64
    assert max_distance(PositionFix("clamp", window=63), 4096) == 63


def test_remap_is_the_identity_inside_the_neighbour_window_and_for_pi_up_to_n_ref():
    i, j = np.arange(40)[:, None], np.arange(40)[None]
    for fix in FIXES:
        p_q, p_k = fix.remap(i, j)
        causal = j <= i
        inside = causal & (i + 1 <= fix.identity_limit)
        assert np.array_equal((p_q - p_k)[inside], (i - j + 0 * j)[inside])
        assert not np.array_equal((p_q - p_k)[causal], (i - j + 0 * j)[causal])  # this test can fail


def test_position_fix_validation_names_the_field():
    for bad, fragment in [(dict(fix="clamp"), "positions.window"), (dict(fix="group", window=4), "positions.group"),
                          (dict(fix="group", window=4, group=1), "positions.group"),
                          (dict(fix="pi", n_ref=8, window=3), "positions.window"),
                          (dict(fix="rope"), "positions.fix"), (dict(fix="pi", n_ref=1), "positions.n_ref")]:
        with pytest.raises(ValueError, match=fragment):
            ScaleSpec.from_dict({"law": "constant", "n_ref": None, "slope": 0.0, "top_k": 2, "positions": bad})
    with pytest.raises(ValueError, match="spec field 'positions': a window"):
        ScaleSpec(law="constant", n_ref=None, slope=0.0, top_k=2, window=4, positions=PositionFix("pi", n_ref=8))


# -- the runtime against a float64 direct computation ---------------------------------------------------------------

def _rot64(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of x (..., D) at positions (...) in float64, straight from the definition."""
    angles = positions[..., None] * inv_freq
    angles = np.concatenate((angles, angles), axis=-1)
    half = x.shape[-1] // 2
    return x * np.cos(angles) + np.concatenate((-x[..., half:], x[..., :half]), axis=-1) * np.sin(angles)


def _raw(T: int, heads: int = 4, kv_heads: int = 2, D: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, heads, T, D, generator=g, dtype=torch.float64),
            torch.randn(1, kv_heads, T, D, generator=g, dtype=torch.float64))


def _post_rope(T: int, rope, D: int = 16, seed: int = 0):
    """float64 (query, key, q_raw, k_raw, inv_freq, factor): raw vectors, and what the model hands the
    attention call, rotated at the true positions 0 .. T-1 and times the attention factor."""
    inv_freq, factor = rope_inv_freq(D, 10000.0, rope)
    inv_freq = inv_freq.double()
    q_raw, k_raw = _raw(T, D=D, seed=seed)
    pos = np.arange(T).astype(float)
    query, key = (factor * torch.as_tensor(_rot64(x.numpy(), pos, inv_freq.numpy())) for x in (q_raw, k_raw))
    return query, key, q_raw, k_raw, inv_freq, factor


def _direct_logits(q_raw, k_raw, fix: PositionFix, inv_freq, factor) -> np.ndarray:
    """(H, T, T) float64 logits of every pair rotated straight at its remapped positions (keys at 0 .. T-1)."""
    T = q_raw.shape[2]
    groups = q_raw.shape[1] // k_raw.shape[1]
    p_q, p_k = fix.remap(np.arange(T)[:, None].astype(float), np.arange(T)[None].astype(float))  # (T, T) each
    q = _rot64(q_raw.numpy()[0][:, :, None, :], p_q, inv_freq.numpy())  # (H, T, T, D): query i rotated for key j
    k = _rot64(np.repeat(k_raw.numpy()[0], groups, axis=0)[:, None, :, :], p_k, inv_freq.numpy())
    return factor ** 2 * (q * k).sum(-1)


@pytest.mark.parametrize("rope", ROPES, ids=["default", "llama3", "yarn"])
@pytest.mark.parametrize("fix", FIXES, ids=[f.fix for f in FIXES])
def test_remapped_logits_match_a_direct_float64_computation(fix, rope):
    T = 40
    query, key, q_raw, k_raw, inv_freq, factor = _post_rope(T, rope)
    pos = torch.arange(T)
    got = remapped_logits(query, key, fix, inv_freq, pos, pos)[0].numpy()  # (H, T, T)
    want = _direct_logits(q_raw, k_raw, fix, inv_freq, factor)
    causal = np.tril(np.ones((T, T), dtype=bool))
    np.testing.assert_allclose(got[:, causal], want[:, causal], rtol=0, atol=ATOL_LOGITS64)
    plain = (query @ key.repeat_interleave(2, dim=1).transpose(-1, -2))[0].numpy()
    inside = causal & (np.arange(T)[:, None] + 1 <= fix.identity_limit)
    np.testing.assert_allclose(got[:, inside], plain[:, inside], rtol=0, atol=ATOL_LOGITS64)  # identity there
    assert np.abs(got - plain)[:, causal].max() > 1e3 * ATOL_LOGITS64  # this test can fail


@pytest.mark.parametrize("rope", ROPES, ids=["default", "llama3", "yarn"])
@pytest.mark.parametrize("fix", FIXES, ids=[f.fix for f in FIXES])
def test_decode_keys_give_the_last_row_its_remapped_logits(fix, rope):
    """A decoding step's query against :func:`decode_keys` has the direct float64 logits of its row, for
    every cache length past the identity limit (the first far key, a few, most of them)."""
    T = 40
    query, key, q_raw, k_raw, inv_freq, factor = _post_rope(T, rope, seed=4)
    want = _direct_logits(q_raw, k_raw, fix, inv_freq, factor)  # (H, T, T)
    for n in (fix.identity_limit + 1, fix.identity_limit + 3, T):
        keys = decode_keys(key[:, :, :n], fix, inv_freq)  # (1, kv, n, D)
        got = (query[:, :, n - 1:n] @ keys.repeat_interleave(2, dim=1).transpose(-1, -2))[0, :, 0].numpy()  # (H, n)
        np.testing.assert_allclose(got, want[:, n - 1, :n], rtol=0, atol=ATOL_LOGITS64)
    plain = (query[:, :, T - 1:] @ key.repeat_interleave(2, dim=1).transpose(-1, -2))[0, :, 0].numpy()
    assert np.abs(got - plain).max() > 1e3 * ATOL_LOGITS64  # the far keys really move (this test can fail)
    if fix.window is not None:  # the neighbour keys are copied as they are
        assert torch.equal(keys[:, :, T - fix.window:], key[:, :, T - fix.window:])


@pytest.mark.parametrize("fix", FIXES, ids=[f.fix for f in FIXES])
def test_partial_rotary_remaps_only_the_rotated_dimensions(fix):
    """RoPE on the first R = 8 of D = 16 dimensions (partial_rotary_factor 0.5): the remap rotates those R
    and leaves the other 8 as RoPE did (their logits do not depend on positions at all)."""
    T, D, R = 40, 16, 8
    inv_freq = rope_inv_freq(R, 10000.0)[0].double()
    q_raw, k_raw = _raw(T, D=D, seed=3)
    pos = torch.arange(T)

    def rope(x, positions):  # rotate the first R dimensions only, float64
        x = x.numpy()
        rotated = _rot64(x[..., :R], positions, inv_freq.numpy())
        return np.concatenate((rotated, np.broadcast_to(x[..., R:], rotated.shape[:-1] + (D - R,))), axis=-1)

    query, key = (torch.as_tensor(rope(x, pos.numpy().astype(float))) for x in (q_raw, k_raw))
    got = remapped_logits(query, key, fix, inv_freq, pos, pos)[0].numpy()  # (H, T, T)
    p_q, p_k = fix.remap(np.arange(T)[:, None].astype(float), np.arange(T)[None].astype(float))  # (T, T)
    q = rope(q_raw[0][:, :, None, :], p_q)  # (H, T, T, D)
    k = rope(k_raw[0].repeat_interleave(2, dim=0)[:, None, :, :], p_k)
    want = (q * k).sum(-1)
    causal = np.tril(np.ones((T, T), dtype=bool))
    np.testing.assert_allclose(got[:, causal], want[:, causal], rtol=0, atol=ATOL_LOGITS64)


@pytest.mark.parametrize("fix", FIXES, ids=[f.fix for f in FIXES])
def test_remapped_attention_is_softmax_of_the_remapped_logits(fix, monkeypatch):
    T, D = 40, 16
    inv_freq = rope_inv_freq(D, 10000.0)[0].double()
    query, key = _raw(T, D=D, seed=1)
    value = torch.randn(1, 2, T, D, dtype=torch.float64)
    pos = torch.arange(T)
    monkeypatch.setattr("sharpdraft_runtime.positions._CHUNK_ELEMENTS", 4 * T * 7)  # several chunks of rows
    got = remapped_attention(query, key, value, 0.25, fix, inv_freq)
    logits = remapped_logits(query, key, fix, inv_freq, pos, pos) * 0.25
    logits = logits.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -torch.inf)
    want = torch.softmax(logits, -1) @ value.repeat_interleave(2, dim=1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    plain = torch.nn.functional.scaled_dot_product_attention(query, key.repeat_interleave(2, dim=1),
                                                             value.repeat_interleave(2, dim=1), is_causal=True,
                                                             scale=0.25)
    rows = slice(0, fix.identity_limit)  # rows whose keys all lie within the identity limit: the plain kernel's
    torch.testing.assert_close(got[:, :, rows], plain[:, :, rows], rtol=0, atol=1e-13)
    assert (got - plain).abs().max() > 1e-3  # this test can fail


@pytest.mark.parametrize("fix", FIXES, ids=[f.fix for f in FIXES])
def test_remapped_attention_in_float32_takes_the_compiled_pass_and_keeps_the_float64_result(fix, monkeypatch):
    """float32 on the CPU: the row groups' far keys are rotated by the compiled pass; the attention equals the
    torch path's and the float64 computation's within float32 rounding (several chunks and, for pi, row groups)."""
    T, D = 40, 16
    inv_freq = rope_inv_freq(D, 10000.0)[0].double()
    query, key = _raw(T, D=D, seed=5)
    value = torch.randn(1, 2, T, D, dtype=torch.float64)
    monkeypatch.setattr("sharpdraft_runtime.positions._CHUNK_ELEMENTS", 4 * T * 7)
    want = remapped_attention(query, key, value, 0.25, fix, inv_freq)  # float64: the torch path
    used = []
    real = fused.rotate_far_keys
    monkeypatch.setattr(fused, "rotate_far_keys", lambda *a, **k: used.append(a[1]) or real(*a, **k))
    got = remapped_attention(query.float(), key.float(), value.float(), 0.25, fix, inv_freq.float())
    assert used  # the compiled pass served (this test can fail)
    monkeypatch.setattr(fused, "_KERNELS", False)
    torch_path = remapped_attention(query.float(), key.float(), value.float(), 0.25, fix, inv_freq.float())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=ATOL_ATTENTION32)
    torch.testing.assert_close(torch_path.double(), want, rtol=0, atol=ATOL_ATTENTION32)


@pytest.mark.parametrize("masked", [False, True], ids=["all-keys", "masked"])
@pytest.mark.parametrize("fix", FIXES + [PositionFix("group", window=4, group=40)], ids=["clamp", "group", "pi", "group40"])
def test_decode_attention_forms_the_remapped_logits_without_writing_keys(fix, masked, monkeypatch):
    """A decoding step's attention on the compiled path (float32 CPU: logits with each far key rotated in the pass,
    no rotated keys written) equals softmax of the float64 remapped logits times the values, and the caller's kernel
    over :func:`decode_keys` (which serves when the compiled pass cannot), within float32 rounding: batch 2, GQA (6
    query heads over 2 key heads), a strided cache, partial rotary (4 of 20 dimensions not rotated), a bool mask,
    a few far keys and thousands."""
    D, inv_freq = 20, rope_inv_freq(16, 10000.0)[0]
    for k_len in (fix.identity_limit + 2, 3000):
        gen = torch.Generator().manual_seed(k_len)
        query = torch.randn(2, 6, 1, D, generator=gen)
        key = torch.randn(2, k_len, 2, D, generator=gen).transpose(1, 2)  # strided, as a cache slice may be
        value = torch.randn(2, 2, k_len, D, generator=gen)
        visible = (torch.arange(k_len) % 3 != 1)[None] if masked else None  # every third key hidden
        far, _ = positions._far_columns(fix, k_len - 1, k_len - 1, k_len)
        q_shift, k_shift = positions._shifts(fix, np.array([k_len - 1]), np.arange(far))
        rotated = key.double().numpy().copy()  # float64 definition: far key j rotated by its own shift
        angle = (k_shift - q_shift)[:, None] * inv_freq.double().numpy()
        x1, x2 = rotated[:, :, :far, :8].copy(), rotated[:, :, :far, 8:16].copy()
        rotated[:, :, :far, :8] = x1 * np.cos(angle) - x2 * np.sin(angle)
        rotated[:, :, :far, 8:16] = x2 * np.cos(angle) + x1 * np.sin(angle)
        logits = 0.3 * query.double() @ torch.from_numpy(rotated).repeat_interleave(3, dim=1).transpose(-1, -2)
        if visible is not None:
            logits = logits.masked_fill(~visible, -torch.inf)
        want = torch.softmax(logits, -1) @ value.double().repeat_interleave(3, dim=1)
        calls = []

        def kernel(q, k, v):
            calls.append(k.shape)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=0.3,
                                                                    enable_gqa=True)

        got = positions.decode_attention(query, key, value, 0.3, fix, inv_freq, kernel, visible)
        assert not calls and got.dtype == torch.float32 and got.shape == (2, 6, 1, D)  # the compiled pass served
        torch.testing.assert_close(got.double(), want, rtol=0, atol=ATOL_ATTENTION32)
        monkeypatch.setattr(fused, "_KERNELS", False)  # as without numba: the kernel over decode_keys
        served = positions.decode_attention(query, key, value, 0.3, fix, inv_freq, kernel, visible)
        monkeypatch.undo()
        assert calls == [key.shape]
        torch.testing.assert_close(served.double(), want, rtol=0, atol=ATOL_ATTENTION32)
    unfixed = kernel(query, key, value).double()
    assert (unfixed - want).abs().max() > 100 * ATOL_ATTENTION32  # the far keys move it (this test can fail)


@pytest.mark.parametrize("case", ["float64", "query-needs-gradient"])
def test_decode_attention_hands_what_the_pass_cannot_take_to_the_callers_kernel(case):
    """float64 (or CUDA, half precision), or a query whose gradient is wanted (the pass's logits would drop it),
    is not the compiled pass's: ``kernel`` attends over :func:`decode_keys`' keys, and its output is returned as it
    is (with its gradient)."""
    fix, inv_freq = PositionFix("clamp", window=3), rope_inv_freq(16, 10000.0)[0]
    dtype = torch.float64 if case == "float64" else torch.float32
    gen = torch.Generator().manual_seed(2)
    query, key, value = (torch.randn(shape, dtype=dtype, generator=gen) for shape in ((1, 2, 1, 16), (1, 1, 30, 16),
                                                                                         (1, 1, 30, 16)))
    query.requires_grad_(case == "query-needs-gradient")
    seen = []

    def kernel(q, k, v):
        seen.append(k)
        return (q * 2).sum() * torch.ones(1, 2, 1, 16)

    out = positions.decode_attention(query, key, value, 0.25, fix, inv_freq, kernel, None)
    assert len(seen) == 1 and out.requires_grad == query.requires_grad
    torch.testing.assert_close(out, kernel(query, key, value), rtol=0, atol=0)
    torch.testing.assert_close(seen[0], decode_keys(key, fix, inv_freq), rtol=0, atol=0)


# A block's float32 logits (compiled pass) against the float64 definition: 20-dimensional unit-variance rows, so
# |q . k| ~ 5 (up to ~20) times 0.3; each rotated key element carries a few float32 ulps (~1e-6) and the dot
# sums 20 products rounded to float32, ~1e-6 of the largest logit; 2e-5 leaves a margin.
ATOL_BLOCK_LOGITS32 = 2e-5


def _block_call(fix: PositionFix, p: int, seed: int, q_len: int = 5):
    """A DFlash-like call: a block of ``q_len`` rows at positions ``p ..`` after ``p`` context keys, the keys at
    their slots ``0 .. p + q_len - 1`` (the block's own last); batch 2, GQA (6 query heads over 2 key heads), partial
    rotary (16 of 20 dimensions), float32."""
    gen = torch.Generator().manual_seed(seed)
    k_len = p + q_len
    query = torch.randn(2, 6, q_len, 20, generator=gen)
    key, value = (torch.randn(2, 2, k_len, 20, generator=gen) for _ in range(2))
    return query, key, value, torch.arange(p, k_len), torch.arange(k_len)


BLOCK_FIXES = FIXES + [PositionFix("group", window=4, group=40)]


@pytest.mark.parametrize("masked", [False, True], ids=["all-keys", "masked"])
@pytest.mark.parametrize("fix", BLOCK_FIXES, ids=["clamp", "group", "pi", "group40"])
def test_a_block_takes_the_compiled_pass_and_keeps_the_eager_result(fix, masked, monkeypatch):
    """A block of rows after its context (keys at their slots, float32 on the CPU) takes one compiled pass over the
    keys (``fused.block_logits``): its logits equal the float64 definition (:func:`remapped_logits`) and its
    attention the eager path's, within float32 rounding, at context lengths whose block lies wholly past the fix's
    threshold, crosses it (some rows or pairs near, some far; pi: rows on both sides of a power of two), and
    thousands of keys past it; and without numba the eager path serves."""
    inv_freq = rope_inv_freq(16, 10000.0)[0]
    used = []
    real = fused.block_logits
    monkeypatch.setattr(fused, "block_logits", lambda *a, **k: used.append(a[3]) or real(*a, **k))
    crossing = fix.identity_limit - 2  # rows p .. p + 4 straddle the threshold
    for p in (crossing, fix.identity_limit + 1, 60, 3000):
        query, key, value, q_pos, k_pos = _block_call(fix, p, seed=p)
        visible = (torch.arange(p + 5) % 3 != 1)[None, None, None] if masked else None
        want = positions.attention_at(query.double(), key.double(), value.double(), 0.3, fix, inv_freq.double(),
                                      q_pos, k_pos, visible)  # float64: the eager path
        used.clear()
        got = positions.attention_at(query, key, value, 0.3, fix, inv_freq, q_pos, k_pos, visible)
        assert used and got.dtype == torch.float32  # the compiled pass served (this test can fail)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=ATOL_ATTENTION32)
        logits = positions._block_logits(query, key, 0.3, fix, inv_freq, q_pos.numpy())
        definition = 0.3 * remapped_logits(query.double(), key.double(), fix, inv_freq.double(), q_pos, k_pos)
        torch.testing.assert_close(logits.double(), definition, rtol=0, atol=ATOL_BLOCK_LOGITS32)
        monkeypatch.setattr(fused, "_KERNELS", False)  # as without numba (or NUMBA_DISABLE_JIT=1): the eager path
        used.clear()
        eager = positions.attention_at(query, key, value, 0.3, fix, inv_freq, q_pos, k_pos, visible)
        monkeypatch.setattr(fused, "_KERNELS", None)  # decided again: numba here
        assert not used
        torch.testing.assert_close(eager.double(), want, rtol=0, atol=ATOL_ATTENTION32)
    plain = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=0.3,
                                                             enable_gqa=True)
    assert (plain.double() - want).abs().max() > 100 * ATOL_ATTENTION32  # the fix moves it (this test can fail)


@pytest.mark.parametrize("case", ["float64", "query-needs-gradient", "keys-not-at-their-slots"])
def test_a_block_the_compiled_pass_cannot_take_runs_in_eager_math(case, monkeypatch):
    """float64 (or CUDA, half precision), a query that wants a gradient (the pass's logits would carry none), or keys
    not at their slots (many blocks side by side in one teacher-forced call) run :func:`remapped_logits`, the
    definition, unchanged (the eager rotation writes into buffers, so a gradient call itself runs under no_grad)."""
    fix, inv_freq = PositionFix("clamp", window=3), rope_inv_freq(16, 10000.0)[0]
    query, key, value, q_pos, k_pos = _block_call(fix, 30, seed=1)
    if case == "float64":
        query, key, value, inv_freq = query.double(), key.double(), value.double(), inv_freq.double()
    query.requires_grad_(case == "query-needs-gradient")
    if case == "keys-not-at-their-slots":
        k_pos = torch.cat((torch.arange(30), torch.arange(40, 45)))
    monkeypatch.setattr(fused, "block_logits", lambda *a, **k: pytest.fail("the compiled pass ran"))
    with torch.no_grad():
        got = positions.attention_at(query, key, value, 0.3, fix, inv_freq, q_pos, k_pos)
        logits = 0.3 * remapped_logits(query, key, fix, inv_freq, q_pos, k_pos)
    want = torch.softmax(logits, -1).view(2, 2, 15, -1) @ value
    torch.testing.assert_close(got, want.view(2, 6, 5, 20), rtol=0, atol=0)


# cos_sin against numpy's float64 cos and sin of the product: angles up to ~1e4 rad carry ~1e-12 of rounding in
# either computation (the angle addition rounds two partial angles instead of one); float32 tables: the products
# of two rounded float32 values, a few ulps of numbers <= 1.
ATOL_TABLE64 = 1e-11
ATOL_TABLE32 = 1e-6


@settings(derandomize=True, deadline=None, max_examples=20)
@given(length=st.integers(1, 2000), first=st.integers(-3000, 3000), fix=st.sampled_from(["clamp", "group", "pi"]),
       group=st.integers(2, 70), k=st.integers(1, 5))
def test_cos_sin_by_angle_addition_matches_the_direct_tables(length, first, fix, group, k):
    """The far keys' shifts of each fix (an arithmetic progression; Self-Extend's j // G - j; pi's multiples of
    1 - 2^-k) take the angle-addition path, and a shuffled copy (which adds up over no period) the direct one:
    both equal the float64 definition."""
    j = np.arange(length)
    shift = {"clamp": first - j, "group": j // group - j + first, "pi": (first - j) * (1 - 2.0 ** -k)}[fix]
    inv_freq = rope_inv_freq(16, 10000.0)[0]
    angles = shift[:, None] * inv_freq.double().numpy()
    period = group if fix == "group" else 1
    M = period * max(1, round(length ** 0.5 / period))  # the period cos_sin tries
    shuffled = shift[::-1][np.argsort(j % 7, kind="stable")]
    assert positions._adds_up(shift, M)  # the fast path is taken (this test can fail)
    assert length < 16 or not positions._adds_up(shuffled, M)
    for shifts, angle in ((shift, angles), (shuffled, None)):
        angle = shifts[:, None] * inv_freq.double().numpy() if angle is None else angle
        for dtype, atol in ((torch.float64, ATOL_TABLE64), (torch.float32, ATOL_TABLE32)):
            cos, sin = cos_sin(np.ascontiguousarray(shifts), inv_freq, dtype, "cpu", period)
            assert cos.dtype == sin.dtype == dtype and cos.shape == angle.shape
            np.testing.assert_allclose(cos.double().numpy(), np.cos(angle), rtol=0, atol=atol)
            np.testing.assert_allclose(sin.double().numpy(), np.sin(angle), rtol=0, atol=atol)


@pytest.mark.parametrize("k_len", [10, 700, 5000])
@pytest.mark.parametrize("fix", FIXES + [PositionFix("group", window=4, group=40)], ids=["clamp", "group", "pi", "group40"])
def test_the_compiled_decode_pass_rotates_as_the_torch_path_and_the_float64_definition(fix, k_len, monkeypatch):
    """float32 keys on the CPU take the compiled pass (``sharpdraft_runtime.fused``); its keys equal the torch
    path's and each far key rotated in float64 by its own shift, within float32 rounding: batch 2, a strided
    cache, partial rotary (4 of 20 dimensions not rotated), a few far keys and thousands (the compiled pass
    carries each row's angle to the next, exact again every ``_kernels.ANCHOR`` rows; the torch path adds
    angles over a period, a multiple of G for group)."""
    assert fused.available()  # numba is a dependency: the compiled pass is what CPU users run
    inv_freq = rope_inv_freq(16, 10000.0)[0]
    key = torch.randn(2, k_len, 3, 20, generator=torch.Generator().manual_seed(3)).transpose(1, 2)  # strided
    far, _ = positions._far_columns(fix, k_len - 1, k_len - 1, k_len)
    q_shift, k_shift = positions._shifts(fix, np.array([k_len - 1]), np.arange(far))
    want = key.double().numpy().copy()  # float64 definition: far key j rotated by its own shift
    angle = (k_shift - q_shift)[:, None] * inv_freq.double().numpy()  # (far, 8)
    x1, x2 = want[:, :, :far, :8].copy(), want[:, :, :far, 8:16].copy()
    want[:, :, :far, :8] = x1 * np.cos(angle) - x2 * np.sin(angle)
    want[:, :, :far, 8:16] = x2 * np.cos(angle) + x1 * np.sin(angle)
    got = decode_keys(key, fix, inv_freq)
    monkeypatch.setattr(fused, "_KERNELS", False)  # as without numba: the torch path
    assert not fused.usable(key)
    torch_path = decode_keys(key, fix, inv_freq)
    assert got.dtype == torch_path.dtype == torch.float32 and got.shape == torch_path.shape == key.shape
    np.testing.assert_allclose(got.double().numpy(), want, rtol=0, atol=ATOL_ROTATED32)
    np.testing.assert_allclose(torch_path.double().numpy(), want, rtol=0, atol=ATOL_ROTATED32)
    assert torch.equal(got[:, :, far:], key[:, :, far:]) and torch.equal(got[..., 16:], key[..., 16:])  # copied
    assert np.abs(want - key.double().numpy()).max() > 1e3 * ATOL_ROTATED32  # the far keys move (this can fail)


def test_the_compiled_pass_steps_aside_when_numba_compiles_nothing(monkeypatch):
    """Under ``NUMBA_DISABLE_JIT=1`` numba would run the kernel as plain Python (seconds a step): the torch path
    serves instead, and gives the same keys."""
    import numba

    key = torch.randn(1, 2, 300, 16, generator=torch.Generator().manual_seed(1))
    fix, inv_freq = PositionFix("clamp", window=7), rope_inv_freq(16, 10000.0)[0]
    compiled = decode_keys(key, fix, inv_freq)
    monkeypatch.setattr(numba.config, "DISABLE_JIT", True)
    monkeypatch.setattr(fused, "_KERNELS", None)  # decided again, as in a fresh process
    assert not fused.available() and not fused.usable(key)
    torch.testing.assert_close(decode_keys(key, fix, inv_freq), compiled, rtol=0, atol=ATOL_ROTATED32)


@settings(derandomize=True, deadline=None, max_examples=20)
@given(k_len=st.integers(2, 9000), fix=st.sampled_from(["clamp", "group", "pi"]), window=st.integers(1, 300),
       group=st.integers(2, 70), n_ref=st.integers(2, 512))
def test_the_decode_table_forms_only_the_shifts_it_adds_up_yet_equals_the_definition(k_len, fix, window, group,
                                                                                      n_ref):
    """``decode_keys``' table, built from the ``far / M + M`` shifts angle addition reads (no check that they
    add up: they do by construction), equals cos and sin of every far key's own shift in float64."""
    fix = {"clamp": PositionFix("clamp", window=window), "group": PositionFix("group", window=window, group=group),
           "pi": PositionFix("pi", n_ref=n_ref)}[fix]
    far, _ = positions._far_columns(fix, k_len - 1, k_len - 1, k_len)
    if far == 0:
        return
    q_shift, k_shift = positions._shifts(fix, np.array([k_len - 1]), np.arange(far))
    angle = (k_shift - q_shift)[:, None] * rope_inv_freq(16, 10000.0)[0].double().numpy()
    for dtype, atol in ((torch.float64, ATOL_TABLE64), (torch.float32, ATOL_TABLE32)):
        cos, sin = positions._decode_table(fix, k_len, far, rope_inv_freq(16, 10000.0)[0], dtype, "cpu")
        assert cos.dtype == sin.dtype == dtype and cos.shape == angle.shape
        np.testing.assert_allclose(cos.double().numpy(), np.cos(angle), rtol=0, atol=atol)
        np.testing.assert_allclose(sin.double().numpy(), np.sin(angle), rtol=0, atol=atol)


def test_rotate_by_zero_is_exact():
    x = torch.randn(1, 2, 5, 8)
    assert torch.equal(rotate(x, torch.zeros(5), rope_inv_freq(8, 10000.0)[0]), x)


# -- eval's variants and what a user deploys -------------------------------------------------------------------------

SPEC = ScaleSpec(law="log-linear", n_ref=8, slope=0.5, top_k=2)


def test_variant_specs_defaults_and_composition():
    spec = ScaleSpec(law="log-linear", n_ref=16, slope=0.5, top_k=2)  # the drafter's n_ref: clamp's W lies below it
    specs = variant_specs(spec, 16, POSITION_VARIANTS, longest=256)
    assert specs["clamp"].positions == PositionFix("clamp", window=15)
    assert specs["group"].positions == PositionFix("group", window=8, group=default_group(16, 256, 8))
    assert specs["pi"].positions == PositionFix("pi", n_ref=16)
    for fix in ("clamp", "group", "pi"):
        assert (specs[fix].law, specs[fix].slope) == ("constant", 0.0)
        assert specs[f"{fix}+spec"] == ScaleSpec.from_dict({**spec.to_dict(), "positions": specs[fix].positions})
    assert variant_specs(spec, 16, ["group"], neighbour_window=4, group=5, longest=256)["group"].positions == \
        PositionFix("group", window=4, group=5)


@pytest.mark.parametrize("options,fragment", [
    (dict(neighbour_window=0), "--neighbour-window 0"), (dict(neighbour_window=-3), "--neighbour-window -3"),
    (dict(neighbour_window=16), "below the drafter's n_ref (16)"), (dict(neighbour_window=10**9), "longest"),
    (dict(group=1), "--group 1"), (dict(group=0), "--group 0"), (dict(group=10**9), "longest"),
    (dict(group=2.5), "--group 2.5")])
def test_fix_options_are_refused_in_one_line(options, fragment):
    with pytest.raises(UserError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        check_variants(["group"], window=None, sinks=4, has_reference=False, n_ref=16, longest=256, **options)


@pytest.fixture(scope="module")
def target():
    return tiny_target(0)


@pytest.fixture(scope="module")
def eagle3(target, tmp_path_factory):
    head = load_eagle3_head(write_tiny_eagle3(tmp_path_factory.mktemp("eagle3"), target, seed=1), target).eval()
    return Eagle3Adapter(head, target, tokenizer=None)


@pytest.mark.parametrize("variant", POSITION_VARIANTS)
def test_eagle3_proposer_drafts_what_eval_measured(eagle3, variant):
    """The chain drafter of a variant's spec (what a user deploys) drafts, after each prompt, the token
    eval's teacher-forced run of that variant drafted at the same row."""
    spec = variant_specs(SPEC, 8, [variant], longest=48)[variant]
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        forced = eagle3.teacher_forced(ids, [(spec, None), (None, None)])
        features = hidden_state_features(eagle3.target, ids, eagle3.feature_ids)
        for rows in (4, 8, 20, 46):  # within the identity limit, at it, past it
            chain = eagle3.proposer(spec)
            chain.start(ids[:, :rows], features[:, :rows], int(ids[0, rows]))
            assert chain.propose(1, GREEDY)[0] == [int(forced.drafted[0, rows - 1])]
    assert not torch.equal(forced.drafted[0], forced.drafted[1])  # the fix changes drafts (this test can fail)


@pytest.mark.parametrize("variant", POSITION_VARIANTS)
def test_eagle3_decoding_steps_equal_the_full_pass(eagle3, variant, monkeypatch):
    """The head's one-row steps over its cache give the logits of its full pass (remapped_attention) row by row,
    in float32, on the compiled path (decode_attention's logits pass) and without it (decode_keys, then the head's
    kernel, sdpa and eager); and differ from the unfixed head."""
    spec = variant_specs(SPEC, 8, [variant], longest=40)[variant]
    head, hook = eagle3.head, sr.query_hook(spec)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        features = hidden_state_features(eagle3.target, ids, eagle3.feature_ids)
        full = head(ids, features, attention_hook=hook, positions=spec.positions)
        unfixed = head(ids, features, attention_hook=hook)
        for implementation, compiled in (("sdpa", True), ("sdpa", False), ("eager", False)):
            monkeypatch.setattr(fused, "_KERNELS", None if compiled else False)  # None: decided again (numba here)
            head.set_attn_implementation(implementation)
            try:
                out = head(ids[:, :20], features[:, :20], attention_hook=hook, positions=spec.positions)
                past, steps = out.past_key_values, []
                for t in range(20, 40):
                    out = head(ids[:, t:t + 1], features[:, t:t + 1], past_key_values=past, attention_hook=hook,
                               positions=spec.positions)
                    past = out.past_key_values
                    steps.append(out.logits)
            finally:
                head.set_attn_implementation("sdpa")
            torch.testing.assert_close(torch.cat(steps, dim=1), full.logits[:, 20:], rtol=0, atol=ATOL_SAME32)
    assert (full.logits - unfixed.logits)[:, 20:].abs().max() > 100 * ATOL_SAME32  # this test can fail


def _tiny_llama(rope_parameters=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
                         **({} if rope_parameters is None else {"rope_parameters": rope_parameters}))
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("variant", POSITION_VARIANTS)
def test_enable_gives_what_eval_measured(variant):
    """``enable(model, spec)`` on a transformers model: its logits equal eval's teacher-forced run of
    the variant (the attention taps), a cached block and one-token decoding steps equal the full pass,
    and up to the identity limit the model is the plain one bit for bit."""
    model = _tiny_llama()
    spec = variant_specs(SPEC, 8, [variant], longest=40)[variant]
    drafter = CausalLMAdapter(model, SimpleNamespace(eos_token_id=None), kind="hf", path="tiny", default_n_ref=8,
                              target=model)
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        short = model(ids[:, :spec.positions.identity_limit]).logits
        forced = drafter.teacher_forced(ids, [(spec, None)])
        measured = _tapped(model, spec, ids)  # the logits behind eval's drafts
        unfixed = _tapped(model, ScaleSpec.from_dict({**spec.to_dict(), "positions": None}), ids)
        sr.enable(model, spec)
        try:
            got = model(ids).logits
            from transformers import DynamicCache

            cache = DynamicCache(config=model.config)
            model(ids[:, :30], cache=cache)
            step = model(ids[:, 30:32], cache=cache).logits
            decoded = torch.cat([model(ids[:, t:t + 1], cache=cache).logits for t in range(32, 40)], dim=1)  # one row each
            short_enabled = model(ids[:, :spec.positions.identity_limit]).logits
        finally:
            sr.disable(model)
    assert torch.equal(got[0].argmax(-1), forced.drafted[0])
    torch.testing.assert_close(got, measured, rtol=0, atol=ATOL_SAME32)
    torch.testing.assert_close(step, got[:, 30:32], rtol=0, atol=ATOL_SAME32)
    torch.testing.assert_close(decoded, got[:, 32:], rtol=0, atol=ATOL_SAME32)  # decode_keys and the model's sdpa
    assert torch.equal(short_enabled, short)
    assert (got - unfixed).abs().max() > 100 * ATOL_SAME32  # the fix changes the logits (this test can fail)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_enabled_decoding_steps_take_the_logits_pass_only_for_plain_sdpa(implementation, monkeypatch):
    """Through ``enable``, a one-token step whose kernel is transformers' sdpa (plain attention) runs
    ``decode_attention``'s compiled logits pass in every layer; a model's own eager function keeps its kernel over
    ``decode_keys``. Either way, and with the compiled pass unavailable, the steps equal the full pass."""
    model = _tiny_llama()
    model.set_attn_implementation(implementation)
    spec = variant_specs(SPEC, 8, ["clamp"], longest=40)["clamp"]
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(8))
    calls = []
    real = fused.decode_logits
    monkeypatch.setattr(fused, "decode_logits", lambda *a, **k: calls.append(a[1].shape[2]) or real(*a, **k))
    from transformers import DynamicCache

    def steps():
        cache = DynamicCache(config=model.config)
        model(ids[:, :30], cache=cache)
        return torch.cat([model(ids[:, t:t + 1], cache=cache).logits for t in range(30, 40)], dim=1)

    with torch.inference_mode():
        sr.enable(model, spec)
        try:
            full = model(ids).logits
            compiled = steps()
            taken = list(calls)
            monkeypatch.setattr(fused, "_KERNELS", False)  # as without numba: the kernel over decode_keys
            served = steps()
        finally:
            sr.disable(model)
        unfixed = model(ids).logits
    layers = model.config.num_hidden_layers
    assert taken == ([k for k in range(31, 41) for _ in range(layers)] if implementation == "sdpa" else [])
    torch.testing.assert_close(compiled, full[:, 30:], rtol=0, atol=ATOL_SAME32)
    torch.testing.assert_close(served, full[:, 30:], rtol=0, atol=ATOL_SAME32)
    assert (full - unfixed)[:, 30:].abs().max() > 100 * ATOL_SAME32  # the fix changes the steps (this test can fail)


def test_the_layers_of_a_decoding_step_share_one_table_dropped_when_the_forward_ends(monkeypatch):
    """Under ``enable``, the two layers of a decoding step build one rotation table between them (not
    one each), and nothing of it is left once the forward returns or raises."""
    from sharpdraft_runtime import hf, positions

    made = []
    real = positions._decode_table  # the torch path's table (the compiled pass has none to share)
    monkeypatch.setattr(positions, "_decode_table", lambda *a, **k: made.append(a[2]) or real(*a, **k))
    monkeypatch.setattr(fused, "_KERNELS", False)
    model = _tiny_llama()
    spec = variant_specs(SPEC, 8, ["clamp"], longest=40)["clamp"]
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(6))
    from transformers import DynamicCache

    with torch.inference_mode():
        sr.enable(model, spec)
        try:
            binding = hf._BINDINGS[id(model.config)]
            cache = DynamicCache(config=model.config)
            model(ids[:, :20], cache=cache)
            made.clear()
            for t in range(20, 23):
                model(ids[:, t:t + 1], cache=cache)
                assert binding.tables is None  # dropped with the forward
            assert len(made) == 3  # one table per step for 2 layers (this test can fail: 6 without sharing)
            with pytest.raises(ValueError, match="cache slot"):
                model(ids[:, 23:24], cache=cache, position_ids=torch.tensor([[5]]))
            assert binding.tables is None  # dropped when the forward raised too
        finally:
            sr.disable(model)
    assert not binding.hooks and not model._forward_hooks and not model._forward_pre_hooks  # disable removes them


def _tapped(model, spec: ScaleSpec, ids: torch.Tensor) -> torch.Tensor:
    """Logits of ``model`` under eval's attention tap with ``spec`` (scaled queries, restrictions, positions)."""
    from calibrate.taps import ScalingTap, attention_tap

    with attention_tap(model, ScalingTap(spec), restrict=spec):
        return model(ids).logits


def test_enable_refuses_a_rope_it_cannot_remap():
    model = _tiny_llama({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported for position fixes"):
        sr.enable(model, ScaleSpec(law="constant", n_ref=None, slope=0.0, top_k=2, positions=PositionFix("pi", n_ref=8)))


def test_at_slots_reads_one_row_as_a_number_and_more_rows_as_tensors():
    assert at_slots(torch.tensor([[9]]), 10) and not at_slots(torch.tensor([[8]]), 10)
    assert at_slots(torch.tensor([[7, 8, 9]]), 10) and at_slots(torch.tensor([[7, 8, 9], [7, 8, 9]]), 10)
    assert not at_slots(torch.tensor([[7, 8, 9], [6, 7, 8]]), 10)  # a left-padded row
    assert not at_slots(torch.tensor([[9], [8]]), 10)
