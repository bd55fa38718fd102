"""DFlash draft model: checkpoint loading, context features, non-causal block attention, the tap.

The float64 reference follows z-lab/dflash's ``dflash/model.py`` as documented in
``calibrate/drafters/dflash.py``: fc + hidden_norm on the context, q_norm / k_norm before RoPE,
keys = cat(context, block), no mask.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from calibrate.drafters import dflash
from calibrate.drafters.dflash import DFlashConfig, DFlashAdapter, context_features, load_dflash
from calibrate.errors import UserError
from sharpdraft_runtime import visible_keys

from tiny_checkpoints import corrupt_checkpoint, tiny_target, write_tiny_dflash

T, BS = 20, 4
MASK = 255


@pytest.fixture(scope="module")
def target():
    return tiny_target(0)


@pytest.fixture(scope="module")
def ckpt(target, tmp_path_factory):
    return write_tiny_dflash(tmp_path_factory.mktemp("dflash"), target, seed=2, block_size=BS)


@pytest.fixture(scope="module")
def model(ckpt, target):
    return load_dflash(ckpt, target)


@pytest.fixture(scope="module")
def input_ids():
    return torch.randint(0, 255, (1, T), generator=torch.Generator().manual_seed(3))


def hf_context_features(target, input_ids, ids):
    with torch.no_grad():
        hs = target(input_ids, output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1] for i in ids], dim=-1)


# ---------------------------------------------------------------------------------------------
# float64 reference
# ---------------------------------------------------------------------------------------------

def _rms(x, w, eps):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x, pos, theta):
    D = x.shape[-1]
    angle = pos[:, None].double() * theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def reference_block(model, feats, noise, p, alpha=None):
    """Normed block output (q, H) and per-layer (query, key) for a block at position p, float64."""
    c = model.config
    sd = {k: v.double() for k, v in model.state_dict().items()}
    ctx = _rms(feats[0, :p].double() @ sd["fc.weight"].T, sd["hidden_norm.weight"], c.rms_norm_eps)
    h = noise[0].double()
    q_len = h.shape[0]
    pos_ctx, pos_blk = torch.arange(p), torch.arange(p, p + q_len)
    groups = c.num_attention_heads // c.num_key_value_heads
    a = 1.0 if alpha is None else float(alpha(torch.tensor(float(p + q_len))))
    seen = []
    for i in range(c.num_hidden_layers):
        w = {k[len(f"layers.{i}."):]: v for k, v in sd.items() if k.startswith(f"layers.{i}.")}
        x = _rms(h, w["input_layernorm.weight"], c.rms_norm_eps)
        heads = lambda t, n: t.view(t.shape[0], n, c.head_dim)  # noqa: E731
        q = _rope(_rms(heads(x @ w["self_attn.q_proj.weight"].T, c.num_attention_heads), w["self_attn.q_norm.weight"],
                       c.rms_norm_eps), pos_blk, c.rope_theta)
        kv_in = torch.cat((ctx, x))
        k = _rope(_rms(heads(kv_in @ w["self_attn.k_proj.weight"].T, c.num_key_value_heads),
                       w["self_attn.k_norm.weight"], c.rms_norm_eps), torch.cat((pos_ctx, pos_blk)), c.rope_theta)
        v = heads(kv_in @ w["self_attn.v_proj.weight"].T, c.num_key_value_heads)
        seen.append((q, k))
        out = torch.stack([torch.softmax(a * (q[:, j] @ k[:, j // groups].T) * c.head_dim ** -0.5, -1)
                           @ v[:, j // groups] for j in range(c.num_attention_heads)], dim=1)  # no mask
        h = h + out.reshape(q_len, -1) @ w["self_attn.o_proj.weight"].T
        m = _rms(h, w["post_attention_layernorm.weight"], c.rms_norm_eps)
        h = h + (torch.nn.functional.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)
                 ) @ w["mlp.down_proj.weight"].T
    return _rms(h, sd["norm.weight"], c.rms_norm_eps), seen


def block_embedding(target, input_ids, p):
    block = torch.full((1, BS), MASK)
    block[0, 0] = input_ids[0, p]
    with torch.no_grad():
        return target.get_input_embeddings()(block)


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------

def test_load_round_trip(ckpt, model):
    saved = load_file(str(ckpt / "model.safetensors"))
    state = model.state_dict()
    assert set(saved) == set(state)
    for key, value in saved.items():
        assert torch.equal(state[key], value), key
    assert "layers.1.self_attn.q_norm.weight" in saved and "embed_tokens.weight" not in saved
    c = model.config
    assert (c.block_size, c.mask_token_id, c.target_layer_ids) == (BS, MASK, (1, 3, 5))
    assert saved["fc.weight"].shape == (64, 3 * 64)


def test_draft_fields_at_top_level_are_read_too(target, tmp_path):
    path = write_tiny_dflash(tmp_path, target, seed=2, block_size=BS, nested=False)
    cfg = json.loads((path / "config.json").read_text())
    assert "dflash_config" not in cfg and cfg["target_layer_ids"] == [1, 3, 5]
    assert load_dflash(path, target).config == DFlashConfig.from_json(path / "config.json")


def test_missing_key_names_it(ckpt, target, tmp_path):
    path = corrupt_checkpoint(ckpt, tmp_path, lambda s: s.pop("layers.1.self_attn.k_norm.weight"))
    with pytest.raises(UserError, match=r"missing weight 'layers\.1\.self_attn\.k_norm\.weight' \(expected shape \(16,\)\)"):
        load_dflash(path, target)


def test_wrong_shape_names_key_and_shapes(ckpt, target, tmp_path):
    path = corrupt_checkpoint(ckpt, tmp_path, lambda s: s.__setitem__("fc.weight", torch.zeros(64, 128)))
    with pytest.raises(UserError, match=r"'fc\.weight' has shape \(64, 128\), expected \(64, 192\)") as e:
        load_dflash(path, target)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["dflash_config"].pop("mask_token_id"), "no 'mask_token_id'"),
    (lambda c: c["dflash_config"].__setitem__("target_layer_ids", [1, 3, 8]), r"target_layer_ids \[1, 3, 8\]"),
    (lambda c: c.__setitem__("architectures", ["DFlash2DraftModel"]), "DFlash2"),
    (lambda c: c.__setitem__("layer_types", ["sliding_attention"]), r"layer_types \['sliding_attention'\]: expected 2"),
    (lambda c: c.__setitem__("layer_types", ["sliding_attention", "full_attention"]), "no 'sliding_window'"),
    (lambda c: c.update(use_sliding_window=True, sliding_window=8), "without layer_types"),
    (lambda c: c["dflash_config"].__setitem__("projector_type", "domino"), "SpecForge knows 'dspark'"),
    (lambda c: c["dflash_config"].__setitem__("attention_mode", "mla"), "attention_mode 'mla' is not supported"),
    (lambda c: c["dflash_config"].__setitem__("attention_mode", "mha"), "and equal it"),
    (lambda c: c.__setitem__("speculators_model_type", "dflash"), "speculators config has no 'transformer_layer_config'"),
    (lambda c: c.__setitem__("rope_scaling", {"rope_type": "mrope", "mrope_section": [2, 3, 3]}), "'mrope'"),
    (lambda c: c.__setitem__("logit_softcap", 30.0), "field 'logit_softcap' is not understood by the DFlash loader"),
    (lambda c: c["dflash_config"].__setitem__("attention_modes", ["mla", "gqa"]),
     "field 'dflash_config.attention_modes' is not understood"),
    (lambda c: c.__setitem__("mlp_bias", True), "mlp_bias true is not supported"),
    (lambda c: c.__setitem__("dflash_config", [1, 2]), "'dflash_config' should be an object"),
])
def test_bad_config_is_a_user_error(ckpt, target, tmp_path, edit, message):
    path = corrupt_checkpoint(ckpt, tmp_path, edit_config=edit)
    with pytest.raises(UserError, match=message):
        load_dflash(path, target)


def _variant(config: dict, state: dict, arch: str) -> None:
    """Make a DFlash checkpoint SpecForge's DSpark or Domino: same backbone, extra logit heads."""
    config["architectures"] = [arch]
    if arch == "DSparkDraftModel":
        config.update(markov_rank=8, markov_head_type="vanilla", enable_confidence_head=True,
                      confidence_head_with_markov=True)
        state.update({"markov_head.markov_w1.weight": torch.randn(256, 8), "markov_head.markov_w2.weight":
                      torch.randn(256, 8), "confidence_head.proj.weight": torch.randn(1, 72),
                      "confidence_head.proj.bias": torch.randn(1)})
    else:
        config["dflash_config"].update(projector_type="domino", emb_dim=32, gru_hidden_dim=16,
                                       pure_draft_prefix_len=0, shift_label=False)
        state.update({"prefix_gru.weight_ih_l0": torch.randn(48, 64), "prefix_gru.weight_hh_l0": torch.randn(48, 16),
                      "embed_proj.0.weight": torch.randn(32, 80), "embed_proj.2.weight": torch.randn(256, 32)})


@pytest.mark.parametrize("arch", ["DSparkDraftModel", "DominoDraftModel"])
def test_dspark_and_domino_load_as_dflash_and_say_so(arch, ckpt, model, target, input_ids, tmp_path):
    """Their attention is DFlash's: the same queries and keys reach the tap; the summary says so."""
    state = {}
    _variant({"dflash_config": {}}, state, arch)  # the extra heads' weights
    path = corrupt_checkpoint(ckpt, tmp_path, edit_weights=lambda s: s.update(state),
                              edit_config=lambda c: _variant(c, {}, arch))
    loaded = load_dflash(path, target)
    drafter = DFlashAdapter(loaded, target, tokenizer=None)
    assert f"{arch} loaded as DFlash" in drafter.notes[1] and "are not run" in drafter.notes[1]
    ours, plain = [], []
    drafter.collect(input_ids, lambda *a: ours.append(a), torch.tensor([7]))
    DFlashAdapter(model, target, tokenizer=None).collect(input_ids, lambda *a: plain.append(a), torch.tensor([7]))
    for a, b in zip(ours, plain, strict=True):
        assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) and torch.equal(a[4], b[4])
    bad = corrupt_checkpoint(path, tmp_path / "bad", edit_weights=lambda s: s.__setitem__("gate.weight", torch.ones(1)))
    with pytest.raises(UserError, match="weight 'gate.weight' is not part of"):
        load_dflash(bad, target)


# ---------------------------------------------------------------------------------------------
# features, forward, attention
# ---------------------------------------------------------------------------------------------

def test_context_features_are_outputs_of_target_layer_ids(target, input_ids):
    with torch.no_grad():
        ours = context_features(target, input_ids, (1, 3, 7))  # 7 = last layer: the normed output
    assert torch.equal(ours, hf_context_features(target, input_ids, (1, 3, 7)))


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_block_matches_float64_reference(impl, model, target, input_ids, p=9):
    feats = hf_context_features(target, input_ids, model.config.target_layer_ids)
    noise = block_embedding(target, input_ids, p)
    model.set_attn_implementation(impl)
    try:
        with torch.no_grad():
            ours = model(noise, feats[:, :p], torch.arange(p + BS)[None])[0].double()
    finally:
        model.set_attn_implementation("sdpa")
    ref, _ = reference_block(model, feats, noise, p)
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4)  # fp32 vs float64, O(1) activations


def test_block_attention_is_non_causal(model, target, input_ids, p=9):
    """The anchor row depends on the *last* mask token: no causal mask inside the block."""
    feats = context_features(target, input_ids, model.config.target_layer_ids)
    noise = block_embedding(target, input_ids, p)
    other = noise.clone()
    other[0, -1] += 1.0
    with torch.no_grad():
        a = model(noise, feats[:, :p], torch.arange(p + BS)[None])
        b = model(other, feats[:, :p], torch.arange(p + BS)[None])
    assert (a[0, 0] - b[0, 0]).abs().max() > 1e-3


def test_collect_places_one_block_per_position(model, target, input_ids):
    calls = []
    positions = torch.tensor([0, 5, 12, T - 1])
    DFlashAdapter(model, target, tokenizer=None).collect(input_ids, lambda *a: calls.append(a), positions)
    L = model.config.num_hidden_layers
    assert [c[0] for c in calls] == list(range(L)) * len(positions)
    feats = hf_context_features(target, input_ids, model.config.target_layer_ids)
    for i, p in enumerate(positions.tolist()):
        _, seen = reference_block(model, feats, block_embedding(target, input_ids, p), p)
        for layer in range(L):
            _, q, k, scaling, n_visible = calls[i * L + layer]
            assert q.shape == (1, 4, BS, 16) and k.shape == (1, 2, p + BS, 16)
            assert scaling == 16 ** -0.5
            assert torch.equal(n_visible, torch.full((1, BS), p + BS))
            assert torch.allclose(q[0].transpose(0, 1).double(), seen[layer][0], atol=1e-4)
            assert torch.allclose(k[0].transpose(0, 1).double(), seen[layer][1], atol=1e-4)
    assert model.config._attn_implementation == "sdpa"  # restored after collect


def alpha_law(n):
    return 1.0 + 0.3 * torch.log(n.double() / 4).clamp(min=0)


def test_registered_query_scaling_equals_scaled_softmax(model, target, input_ids, p=13):
    """A function registered with transformers' AttentionInterface sees post-RoPE queries and can
    scale them: the result equals softmax(alpha * q k^T * scaling) v in float64."""
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def scaled(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        n = visible_keys(query, key, attention_mask, is_causal=kwargs.get("is_causal"), module=module)
        assert n == p + BS  # a non-causal block: every query sees the context and the whole block
        query = query * alpha_law(torch.tensor(float(n)))
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    AttentionInterface.register("test_dflash_scaled", scaled)
    feats = hf_context_features(target, input_ids, model.config.target_layer_ids)
    noise = block_embedding(target, input_ids, p)
    model.set_attn_implementation("test_dflash_scaled")
    try:
        with torch.no_grad():
            ours = model(noise, feats[:, :p], torch.arange(p + BS)[None])[0].double()
    finally:
        model.set_attn_implementation("sdpa")
    ref, _ = reference_block(model, feats, noise, p, alpha=alpha_law)
    plain, _ = reference_block(model, feats, noise, p)
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(ref, plain, atol=1e-2)


def test_adapter_identity(model, target):
    d = DFlashAdapter(model, target, tokenizer=None, path="x")
    assert d.kind == "dflash" and d.default_n_ref == 3072
    assert (d.info.num_layers, d.info.num_heads, d.info.num_kv_heads, d.info.head_dim) == (2, 4, 2, 16)

def test_a_missing_built_in_head_is_named_with_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setattr(dflash, "DFLASH_HEAD_DIR", tmp_path / "dflash-smollm2")
    with pytest.raises(UserError, match="the DFlash head for SmolLM2 is missing .*scripts/train_dflash.py"):
        dflash.load("dflash", None, None, torch.device("cpu"), torch.float32)


@pytest.mark.slow
def test_the_built_in_head_loads_with_smollm2_and_its_training_length():
    drafter = dflash.load("dflash", None, None, torch.device("cpu"), torch.float32)
    record = json.loads((dflash.DFLASH_HEAD_DIR / "training_log.json").read_text())
    assert drafter.info.path is None and drafter.default_n_ref == record["n_ref"]
    assert drafter.model.config.hidden_state_ids == (2, 15, 27)  # the features SmolLM2's shards hold
