"""EAGLE-3 head: checkpoint loading, target features and their shift, the attention hook.

The reference below is written from the math in ``calibrate/drafters/eagle3.py``'s docstring (and
EAGLE's ``cnets.py``) in float64, independently of the module: per-row RMSNorm, rotate-half RoPE,
causal GQA softmax, residual on the un-normed ``fc`` output.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from calibrate.drafters import eagle3
from calibrate.drafters.eagle3 import (Eagle3Config, Eagle3Adapter, feature_layer_ids, load_eagle3_head,
                                       target_features)
from calibrate.errors import UserError

from tiny_checkpoints import corrupt_checkpoint, tiny_target, write_tiny_eagle3

T = 24  # tokens per test sequence


@pytest.fixture(scope="module")
def target():
    return tiny_target(0)


@pytest.fixture(scope="module")
def ckpt(target, tmp_path_factory):
    return write_tiny_eagle3(tmp_path_factory.mktemp("eagle3"), target, seed=1)


@pytest.fixture(scope="module")
def head(ckpt, target):
    return load_eagle3_head(ckpt, target)


@pytest.fixture(scope="module")
def input_ids():
    return torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(7))


# ---------------------------------------------------------------------------------------------
# float64 reference
# ---------------------------------------------------------------------------------------------

def _rms(x, w, eps):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x, pos, theta):
    """x (T, heads, D), pos (T,): rotate pairs (i, i + D/2) by pos * theta^(-2i/D)."""
    D = x.shape[-1]
    angle = pos[:, None].double() * theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (T, D/2)
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def reference_head(head, tokens, feats, alpha=None):
    """Logits and (q, k) of the head in float64 for one sequence; ``alpha(n_visible)`` scales queries."""
    c = head.config
    sd = {k: v.double() for k, v in head.state_dict().items() if v.dtype.is_floating_point}
    tokens, feats = tokens[0], feats[0].double()
    n = tokens.shape[0]
    g = feats @ sd["fc.weight"].T
    e = sd["embed_tokens.weight"][tokens]
    x = torch.cat((_rms(e, sd["midlayer.input_layernorm.weight"], c.rms_norm_eps),
                   _rms(g, sd["midlayer.hidden_norm.weight"], c.rms_norm_eps)), -1)
    pos = torch.arange(n)
    q = _rope((x @ sd["midlayer.self_attn.q_proj.weight"].T).view(n, c.num_attention_heads, c.head_dim), pos, c.rope_theta)
    k = _rope((x @ sd["midlayer.self_attn.k_proj.weight"].T).view(n, c.num_key_value_heads, c.head_dim), pos, c.rope_theta)
    v = (x @ sd["midlayer.self_attn.v_proj.weight"].T).view(n, c.num_key_value_heads, c.head_dim)
    groups = c.num_attention_heads // c.num_key_value_heads
    n_visible = torch.arange(1, n + 1, dtype=torch.float64)
    a = torch.ones(n, dtype=torch.float64) if alpha is None else alpha(n_visible)
    out = torch.empty(n, c.num_attention_heads, c.head_dim, dtype=torch.float64)
    for h in range(c.num_attention_heads):
        s = a[:, None] * (q[:, h] @ k[:, h // groups].T) * c.head_dim ** -0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out[:, h] = torch.softmax(s, -1) @ v[:, h // groups]
    r = g + out.reshape(n, -1) @ sd["midlayer.self_attn.o_proj.weight"].T
    m = _rms(r, sd["midlayer.post_attention_layernorm.weight"], c.rms_norm_eps)
    mlp = (torch.nn.functional.silu(m @ sd["midlayer.mlp.gate_proj.weight"].T) * (m @ sd["midlayer.mlp.up_proj.weight"].T)
           ) @ sd["midlayer.mlp.down_proj.weight"].T
    o = r + mlp
    return _rms(o, sd["norm.weight"], c.rms_norm_eps) @ sd["lm_head.weight"].T, q, k


def hf_features(target, input_ids):
    """cat(hidden_states[2], hidden_states[L//2], hidden_states[L-3]) from transformers' own output."""
    with torch.no_grad():
        hs = target(input_ids, output_hidden_states=True).hidden_states
    L = len(hs) - 1
    return torch.cat((hs[2], hs[L // 2], hs[L - 3]), dim=-1)


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------

def test_load_round_trip(ckpt, head, target):
    saved = load_file(str(ckpt / "model.safetensors"))
    assert "embed_tokens.weight" not in saved
    state = head.state_dict()
    for key, value in saved.items():
        assert torch.equal(state[key], value), key
    assert head.embed_tokens is target.get_input_embeddings()
    assert head.config == Eagle3Config.from_dict(json.loads((ckpt / "config.json").read_text()))
    assert head.d2t.dtype == torch.long and head.t2d.dtype == torch.bool
    ids = torch.arange(head.config.draft_vocab_size)
    mapped = head.draft_to_target(ids)
    assert torch.equal(mapped, head.t2d.nonzero().flatten())  # d2t is an offset into the sorted kept ids


@pytest.mark.parametrize("variant", ["layers0", "bin", "embed"])
def test_load_variants_give_same_outputs(variant, ckpt, head, target, tmp_path, input_ids):
    saved = load_file(str(ckpt / "model.safetensors"))
    (tmp_path / "config.json").write_text((ckpt / "config.json").read_text())
    if variant == "layers0":  # vLLM spells midlayer.* as layers.0.*
        save_file({k.replace("midlayer.", "layers.0."): v for k, v in saved.items()},
                  str(tmp_path / "model.safetensors"))
    elif variant == "bin":
        torch.save(saved, tmp_path / "pytorch_model.bin")
    else:  # the head carries its own embedding (a copy of the target's here)
        saved["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
        save_file(saved, str(tmp_path / "model.safetensors"))
    other = load_eagle3_head(tmp_path, None if variant == "embed" else target)
    feats = target_features(target, input_ids)
    with torch.no_grad():
        a = head(input_ids[:, 1:], feats[:, :-1]).logits
        b = other(input_ids[:, 1:], feats[:, :-1]).logits
    assert torch.equal(a, b)


def test_missing_key_names_it(ckpt, target, tmp_path):
    path = corrupt_checkpoint(ckpt, tmp_path, lambda s: s.pop("midlayer.self_attn.k_proj.weight"))
    with pytest.raises(UserError, match=r"missing weight 'midlayer\.self_attn\.k_proj\.weight' \(expected shape \(32, 128\)\)"):
        load_eagle3_head(path, target)


def test_wrong_shape_names_key_and_shapes(ckpt, target, tmp_path):
    path = corrupt_checkpoint(ckpt, tmp_path, lambda s: s.__setitem__("fc.weight", torch.zeros(64, 128)))
    with pytest.raises(UserError, match=r"'fc\.weight' has shape \(64, 128\), expected \(64, 192\)") as e:
        load_eagle3_head(path, target)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_missing_d2t_with_pruned_vocab(ckpt, target, tmp_path):
    path = corrupt_checkpoint(ckpt, tmp_path, lambda s: s.pop("d2t"))
    with pytest.raises(UserError, match="missing weight 'd2t'"):
        load_eagle3_head(path, target)


def test_bad_config_and_missing_files(ckpt, target, tmp_path):
    with pytest.raises(UserError, match="neither model.safetensors nor pytorch_model.bin"):
        (tmp_path / "config.json").write_text((ckpt / "config.json").read_text())
        load_eagle3_head(tmp_path, target)
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="config.json has no 'hidden_size'"):
        load_eagle3_head(tmp_path, target)
    with pytest.raises(UserError, match="not a directory"):
        load_eagle3_head(tmp_path / "nope", target)


def test_config_defaults():
    c = Eagle3Config.from_dict({"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 8,
                                "vocab_size": 10})
    assert (c.num_key_value_heads, c.head_dim, c.target_hidden_size, c.draft_vocab_size) == (4, 16, 64, 10)
    assert (c.rope_theta, c.max_position_embeddings, c.norm_before_residual) == (10000.0, 2048, False)


# ---------------------------------------------------------------------------------------------
# features and shift
# ---------------------------------------------------------------------------------------------

def test_feature_indices_match_transformers_hidden_states(target, input_ids):
    assert feature_layer_ids(8) == (2, 4, 5)
    assert feature_layer_ids(32) == (2, 16, 29)  # Llama-3.1-8B: inputs of layers 2, 16, 29
    with torch.no_grad():
        ours = target_features(target, input_ids)
    assert torch.equal(ours, hf_features(target, input_ids))


def test_too_shallow_target_is_a_user_error():
    with pytest.raises(UserError, match="at least 7 layers"):
        feature_layer_ids(6)


def test_head_matches_float64_reference(head, target, input_ids):
    feats = hf_features(target, input_ids)
    ref, _, _ = reference_head(head, input_ids[:, 1:], feats[:, :-1])
    with torch.no_grad():
        ours = head(input_ids[:, 1:], feats[:, :-1]).logits[0].double()
    # fp32 forward vs float64 reference; logits are O(1), rounding is ~1e-6 per op
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4)


def test_collect_pairs_feature_t_with_token_t_plus_1(head, target, input_ids):
    calls = []
    drafter = Eagle3Adapter(head, target, tokenizer=None)
    drafter.collect(input_ids, lambda *a: calls.append(a), torch.tensor([3, 10, 20]))
    assert len(calls) == 1
    layer, q, k, scaling, n_visible = calls[0]
    _, q_ref, k_ref = reference_head(head, input_ids[:, 1:], hf_features(target, input_ids)[:, :-1])
    assert layer == 0 and scaling == head.config.head_dim ** -0.5
    assert q.shape == (1, 4, T - 1, 16) and k.shape == (1, 2, T - 1, 16)
    assert torch.allclose(q[0].transpose(0, 1).double(), q_ref, atol=1e-5)
    assert torch.allclose(k[0].transpose(0, 1).double(), k_ref, atol=1e-5)
    assert torch.equal(n_visible, torch.arange(1, T)[None])
    # pairing feature t with token t (no shift) gives different queries: the test sees the shift
    _, q_wrong, _ = reference_head(head, input_ids[:, :-1], hf_features(target, input_ids)[:, :-1])
    assert not torch.allclose(q[0].transpose(0, 1).double(), q_wrong, atol=1e-2)


def test_adapter_identity(head, target):
    d = Eagle3Adapter(head, target, tokenizer=None, path="some/dir")
    assert d.kind == "eagle3" and d.default_n_ref == 64 and d.device == torch.device("cpu")
    assert (d.info.num_layers, d.info.num_heads, d.info.num_kv_heads, d.info.head_dim) == (1, 4, 2, 16)


def test_missing_demo_head_is_a_user_error(monkeypatch, tmp_path):
    monkeypatch.setattr(eagle3, "DEMO_HEAD_DIR", tmp_path / "eagle3-smollm2")
    with pytest.raises(UserError, match="demo EAGLE-3 head for SmolLM2 is missing"):
        eagle3.load("eagle3", None, None, torch.device("cpu"), torch.float32)


# ---------------------------------------------------------------------------------------------
# the attention hook
# ---------------------------------------------------------------------------------------------

def alpha_law(n):
    return 1.0 + 0.3 * torch.log(n.double() / 4).clamp(min=0)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_query_scaling_hook_equals_scaled_softmax(impl, head, target, input_ids):
    feats = hf_features(target, input_ids)

    def scale(layer_idx, query, key, scaling, n_visible):
        query.mul_(alpha_law(n_visible)[:, None, :, None].to(query.dtype))  # in place, per row

    head.set_attn_implementation(impl)
    try:
        with torch.no_grad():
            ours = head(input_ids[:, 1:], feats[:, :-1], attention_hook=scale).logits[0].double()
    finally:
        head.set_attn_implementation("sdpa")
    ref, _, _ = reference_head(head, input_ids[:, 1:], feats[:, :-1], alpha=alpha_law)
    plain, _, _ = reference_head(head, input_ids[:, 1:], feats[:, :-1])
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4)  # same budget as the unscaled check
    assert not torch.allclose(ref, plain, atol=1e-2)  # the scaling is visible at this size


def test_hook_with_cache_sees_all_keys_and_offset_n_visible(head, target, input_ids):
    feats = target_features(target, input_ids)
    seen = []
    with torch.no_grad():
        full = head(input_ids[:, 1:], feats[:, :-1])
        first = head(input_ids[:, 1:11], feats[:, :10])
        step = head(input_ids[:, 11:14], feats[:, 10:13], past_key_values=first.past_key_values,
                    attention_hook=lambda *a: seen.append(a))
    (_, q, k, _, n_visible), = seen
    assert q.shape == (1, 4, 3, 16) and k.shape == (1, 2, 13, 16)
    assert torch.equal(n_visible, torch.tensor([[11, 12, 13]]))
    assert torch.allclose(step.logits, full.logits[:, 10:13], atol=1e-5)
    # the drafter's own output hidden state (width H) skips fc
    nxt = head(input_ids[:, 14:15], step.hidden_states[:, -1:], past_key_values=step.past_key_values)
    assert nxt.logits.shape == (1, 1, 128) and nxt.past_key_values[0].shape[2] == 14


def test_hook_may_return_a_replacement_query(head, target, input_ids):
    feats = target_features(target, input_ids)
    with torch.no_grad():
        a = head(input_ids[:, 1:], feats[:, :-1], attention_hook=lambda l, q, k, s, n: 2 * q).logits
        b = head(input_ids[:, 1:], feats[:, :-1], attention_hook=lambda l, q, k, s, n: q.mul_(2)).logits
    assert torch.equal(a, b)


@pytest.mark.parametrize("name, n_ref, seen", [("eagle3-smollm2", 256, 256), ("eagle3-smollm2-far", 256, 8192),
                                               ("eagle3-smollm2-long", 8192, 8192)])
def test_packaged_heads_state_their_training_length(name, n_ref, seen):
    """Each packaged head ships its weights (under 15 MiB), a TRAINING.md and a training record whose
    n_ref is what calibrate and eval read with no flag; the every-distance head keeps the demo head's
    key count but states the distances it saw (8,191 back), the W of calibrate's drift verdict."""
    from calibrate.drafters.checkpoint import training_length
    from calibrate.run import _trained_window

    folder = eagle3.DEMO_HEAD_DIR.parent / name
    assert (folder / "TRAINING.md").is_file()
    assert (folder / "model.safetensors").stat().st_size < 15 * 2**20
    config = json.loads((folder / "config.json").read_text())
    length = training_length(folder, config["max_position_embeddings"], trust_mpe=True)
    assert length.value == n_ref == config["max_position_embeddings"] and "training_log.json" in length.origin

    class Drafter:  # what _trained_window reads of a loaded drafter
        training, default_n_ref = length, length.value

    assert _trained_window(Drafter()) == seen
    tensors = load_file(folder / "model.safetensors")
    assert "embed_tokens.weight" not in tensors and tensors["d2t"].numel() == config["draft_vocab_size"]
