"""Released drafter formats: real config.json files rebuilt as tiny random checkpoints, loaded and checked.

Each config in ``tests/data/drafter_configs/`` (with its public source beside it) is shrunk to the
tiny target's width (64, heads 4 / 2, head_dim 16), vocabulary and depth, keeping every field that
changes the computation (RoPE, norms, windows, aux ids), and written in its project's own key
layout. The float64 reference of the attention inputs (post-RoPE queries and keys) is written
here from the source projects' math (summarised in ``docs/drafters.md``),
independently of ``calibrate.drafters``: its own RoPE frequencies (default, llama3, yarn with its
attention factor on cos and sin), norms and aux-layer reading.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.drafters import eagle3
from calibrate.drafters.checkpoint import MPE_TRUST_LIMIT
from calibrate.drafters.dflash import DFlashAdapter
from calibrate.drafters.eagle3 import Eagle3Config, Eagle3Head
from calibrate.drafters.layers import read_rope
from calibrate.errors import UserError

from test_calibrate import VOCAB, _write_tokenizer
from tiny_checkpoints import tiny_target, write_tiny_dflash

CONFIGS = Path(__file__).parent / "data" / "drafter_configs"
T = 24  # tokens per test sequence
# the tiny target's 8 layers stand in for the real target's: each id list is mapped by hand
AUX = {"specforge-qwen3-235b-a22b-eagle3": [1, 3, 5],  # SpecForge ids, read as h[k + 1] -> [2, 4, 6]
       "speculators-eagle3-mistral123b-yarn": [2, 4, 5],  # h-indices
       "speculators-eagle3-qwen3moe-swa-normbeforefc": [2, 4, 5, 6]}
EAGLE_CONFIGS = ["specforge-llama3-70b-eagle3-llama3rope", "specforge-qwen3-235b-a22b-eagle3",
                 "specforge-qwen3-30b-a3b-eagle3.1", "speculators-eagle3-mistral123b-yarn",
                 "speculators-eagle3-qwen3moe-swa-normbeforefc"]
WINDOW = 8  # shrunk sliding window, so that it binds within T


def real_config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def shrink_decoder(name: str, vocab: int) -> dict:
    """The real config with its decoder (top level, or speculators' nested one) shrunk to the tiny target's;
    every other field kept."""
    d = copy.deepcopy(real_config(name))
    inner = d.get("transformer_layer_config", d)
    inner.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                 vocab_size=vocab)
    if inner.get("sliding_window"):
        inner["sliding_window"] = WINDOW
    return d


def shrink_eagle(name: str, vocab: int) -> dict:
    """The real EAGLE-3 config shrunk to the tiny target's (``shrink_decoder``), with its aux ids scaled."""
    d = shrink_decoder(name, vocab)
    d["draft_vocab_size"] = 128
    if name in AUX:
        if "eagle_config" in d:
            d["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = AUX[name]
        else:
            d["eagle_aux_hidden_state_layer_ids"] = AUX[name]
    return d


def layout_keys(d: dict) -> set[str]:
    """The weight names each project saves (docs/drafters.md: SafeAILab/SpecForge ``midlayer.*`` plus
    ``fc_norm.{j}``; speculators ``layers.0.*`` plus ``input_norm`` and Qwen3 q/k norms)."""
    speculators = "speculators_model_type" in d
    layer = "layers.0." if speculators else "midlayer."
    keys = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
            *(layer + k for k in ("hidden_norm.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
                                  "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                  "mlp.down_proj.weight"))}
    if d.get("norm_before_fc"):
        keys.add("input_norm.weight")
    if d.get("fc_norm"):
        n = len(d.get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0])
        keys |= {f"fc_norm.{j}.weight" for j in range(n)}
    if speculators and d["transformer_layer_config"].get("model_type") == "qwen3":
        keys |= {layer + "self_attn.q_norm.weight", layer + "self_attn.k_norm.weight"}
    return keys


def write_eagle(directory: Path, name: str, vocab: int = 256, seed: int = 0, edit=None) -> Path:
    """A random head for the shrunk config ``name`` in its project's key layout."""
    d = shrink_eagle(name, vocab)
    if edit:
        edit(d)
    with torch.device("meta"):
        head = Eagle3Head(Eagle3Config.from_dict(copy.deepcopy(d)))
    g = torch.Generator().manual_seed(seed)
    state = {}
    for key, ref in sorted(head.state_dict().items()):
        if key == "embed_tokens.weight" or not ref.dtype.is_floating_point:
            continue
        state[key.replace("midlayer.", "layers.0.") if "speculators_model_type" in d else key] = (
            1.0 + 0.1 * torch.randn(ref.shape, generator=g) if ref.dim() == 1
            else torch.randn(ref.shape, generator=g) * ref.shape[-1] ** -0.5)
    used = torch.randperm(vocab, generator=g)[:128].sort().values
    state["d2t"] = used - torch.arange(128)
    state["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, used, True)
    assert set(state) == layout_keys(d)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(d, indent=2))
    save_file(state, str(directory / "model.safetensors"))
    return directory


# ---------------------------------------------------------------------------------------------
# float64 reference
# ---------------------------------------------------------------------------------------------

def ref_inv_freq(rope: dict, theta: float, dim: int) -> tuple[torch.Tensor, float]:
    """RoPE frequencies and attention factor in float64, from the published formulas."""
    base = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    kind = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
    if kind == "default":
        return base, 1.0
    f, orig = float(rope["factor"]), rope["original_max_position_embeddings"]
    if kind == "llama3":
        lo, hi = rope["low_freq_factor"], rope["high_freq_factor"]
        wavelen = 2 * math.pi / base
        s = (orig / wavelen - lo) / (hi - lo)
        mid = (1 - s) * base / f + s * base
        return torch.where(wavelen > orig / lo, base / f, torch.where(wavelen < orig / hi, base, mid)), 1.0
    assert kind == "yarn"

    def corr(r):
        return dim * math.log(orig / (2 * math.pi * r)) / (2 * math.log(theta))

    low = max(math.floor(corr(rope.get("beta_fast", 32))), 0)
    high = min(math.ceil(corr(rope.get("beta_slow", 1))), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    def mscale(m):  # yarn_get_mscale of SpecForge's LlamaYarnRotaryEmbedding (and DeepSeek's)
        return 0.1 * m * math.log(f) + 1 if f > 1 else 1.0

    a = rope.get("attention_factor") or mscale(rope.get("mscale", 1)) / mscale(rope.get("mscale_all_dim", 0))
    return (1 - ramp) * base + ramp * base / f, a


def rms(x, w, eps):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope_of(d: dict) -> tuple[dict, float]:
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    return params, params.get("rope_theta", d.get("rope_theta", 10000.0))


def rotate(x, pos, params: dict, theta: float, partial: float = 1.0):
    """Float64 RoPE of x (n, heads, D) at positions pos (n,), as vLLM / SGLang apply it: rotate-half on the
    first R = int(D * partial) dimensions, the rest passed through; mrope (SpecForge's
    apply_multimodal_rotary_pos_emb) takes section i of cos / sin from position stream i % 3, and all three
    streams are the token positions for text."""
    D = x.shape[-1]
    R = int(D * partial)
    kind = params.get("rope_type", params.get("type", "default")) if params else "default"
    inv, a = ref_inv_freq({} if kind == "mrope" else params, theta, R)
    angle = pos.double()[:, None] * inv
    cos, sin = torch.cat((angle.cos(), angle.cos()), -1), torch.cat((angle.sin(), angle.sin()), -1)  # (n, R)
    if kind == "mrope":
        cos3, sin3 = [cos] * 3, [sin] * 3  # streams (t, h, w): for text tokens each is the token's position
        parts = params["mrope_section"] * 2
        cos = torch.cat([cos3[i % 3].split(parts, -1)[i] for i in range(len(parts))], -1)
        sin = torch.cat([sin3[i % 3].split(parts, -1)[i] for i in range(len(parts))], -1)
    cos, sin = (a * cos)[:, None], (a * sin)[:, None]
    xr, rest = x[..., :R], x[..., R:]
    rotated = torch.cat((-xr[..., R // 2:], xr[..., :R // 2]), -1)
    return torch.cat((xr * cos + rotated * sin, rest), -1)


def partial_of(d: dict) -> float:
    params = d.get("rope_parameters") or {}
    return d.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))


def reference_qk(d: dict, state: dict, hs, tokens, h_ids):
    """Post-RoPE q (n, heads, D) and k (n, kv, D) of an EAGLE-3 head (speculators core / SpecForge
    llama3_eagle math), rows t = features at t with token t + 1, positions 0..n-1."""
    inner = d.get("transformer_layer_config", d)
    eps = inner["rms_norm_eps"]
    w = {k.replace("layers.0.", "midlayer."): v.double() for k, v in state.items() if v.dtype.is_floating_point}
    f = torch.cat([hs[i][0, :-1].double() for i in h_ids], -1)  # (n, k * H)
    if d.get("norm_before_fc"):
        f = rms(f, w["input_norm.weight"], eps)
    if d.get("fc_norm"):
        f = torch.cat([rms(c, w[f"fc_norm.{j}.weight"], eps) for j, c in enumerate(f.split(64, -1))], -1)
    g = f @ w["fc.weight"].T
    e = w["embed_tokens.weight"][tokens[0, 1:]]
    x = torch.cat((rms(e, w["midlayer.input_layernorm.weight"], eps), rms(g, w["midlayer.hidden_norm.weight"], eps)), -1)
    n = x.shape[0]
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, 4, 16)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, 2, 16)
    if inner.get("model_type") == "qwen3" and "transformer_layer_config" in d:
        q, k = rms(q, w["midlayer.self_attn.q_norm.weight"], eps), rms(k, w["midlayer.self_attn.k_norm.weight"], eps)
    params, theta = rope_of(inner)
    pos = torch.arange(n)
    return rotate(q, pos, params, theta, partial_of(inner)), rotate(k, pos, params, theta, partial_of(inner))


# ---------------------------------------------------------------------------------------------
# EAGLE-3 formats
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def target():
    return tiny_target(0)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(5))


EXPECTED_H = {"specforge-llama3-70b-eagle3-llama3rope": (2, 4, 5), "specforge-qwen3-235b-a22b-eagle3": (2, 4, 6),
              "specforge-qwen3-30b-a3b-eagle3.1": (2, 4, 5), "speculators-eagle3-mistral123b-yarn": (2, 4, 5),
              "speculators-eagle3-qwen3moe-swa-normbeforefc": (2, 4, 5, 6)}


def drafter_for(path, target) -> eagle3.Eagle3Adapter:
    head = eagle3.load_eagle3_head(path, target)
    return eagle3.Eagle3Adapter(head, target, tokenizer=None, path=str(path))


@pytest.mark.parametrize("name", EAGLE_CONFIGS)
def test_eagle_formats_match_their_reference(name, target, tokens, tmp_path):
    path = write_eagle(tmp_path / name, name)
    drafter = drafter_for(path, target)
    assert drafter.feature_ids == EXPECTED_H[name]
    calls = []
    drafter.collect(tokens, lambda *a: calls.append(a), torch.tensor([5]))
    (layer, q, k, scaling, n_visible), = calls
    d = json.loads((path / "config.json").read_text())
    from safetensors.torch import load_file
    state = {**load_file(str(path / "model.safetensors")), "embed_tokens.weight": target.get_input_embeddings().weight}
    with torch.no_grad():
        hs = target(tokens, output_hidden_states=True).hidden_states
    q_ref, k_ref = reference_qk(d, state, hs, tokens, EXPECTED_H[name])
    rows = q.shape[2]
    windowed = (d.get("transformer_layer_config") or {}).get("layer_types") == ["sliding_attention"]
    assert rows == (WINDOW if windowed else T - 1)  # only rows whose visible keys are the first n
    assert torch.equal(n_visible, torch.arange(1, rows + 1)[None])
    # fp32 head vs float64 reference, O(1) activations (times yarn's a = 1.35): ~1e-6 per op
    assert torch.allclose(q[0].transpose(0, 1).double(), q_ref[:rows], atol=1e-4)
    assert torch.allclose(k[0].transpose(0, 1).double(), k_ref[:rows], atol=1e-4)


def test_rope_parameters_yarn_factor_reaches_the_logits(tmp_path):
    """yarn's attention factor multiplies cos and sin, so q and k each carry a = 0.1 ln 32 + 1."""
    d = shrink_eagle("speculators-eagle3-mistral123b-yarn", 256)
    theta, scaling = read_rope(d["transformer_layer_config"], "x", "EAGLE-3")
    assert theta == 1e6 and scaling.rope_type == "yarn"
    from calibrate.drafters.layers import rope_inv_freq
    inv, a = rope_inv_freq(16, theta, scaling)
    inv_ref, a_ref = ref_inv_freq(d["transformer_layer_config"]["rope_parameters"], theta, 16)
    assert a == pytest.approx(1.3466, abs=1e-4) and a == pytest.approx(a_ref, rel=1e-12)
    assert torch.allclose(inv.double(), inv_ref, rtol=1e-6)


@pytest.mark.parametrize("where, written, expected, rule", [
    ("eagle_config", [1, 3, 5], (2, 4, 6), "sglang"),  # SpecForge's Qwen3-235B head: first id 1, read + 1
    ("eagle_config", [2, 3, 5], (2, 3, 5), "sglang"),  # Kimi-K2.5 ([2, 30, 58]) style: first id 2, read as is
    ("eagle_config", [4, 5, 6], (4, 5, 6), "sglang"),  # step-3.5 ([4, 20, 40]) style: read as is
    ("top level", [1, 3, 5], (1, 3, 5), "vllm"),  # a flat LlamaForCausalLMEagle3 config with vLLM's top-level ids
])
def test_aux_ids_are_read_as_the_engine_their_spelling_names(where, written, expected, rule, target, tmp_path):
    """SGLang (since PR #25454) adds 1 only when the first id is 1; ids at the top level are vLLM's (as is)."""
    def edit(d):
        d.pop("eagle_config", None)
        if where == "eagle_config":
            d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": written}
        else:
            d["eagle_aux_hidden_state_layer_ids"] = written
    path = write_eagle(tmp_path / "sf", "specforge-qwen3-235b-a22b-eagle3", edit=edit)
    head = eagle3.load_eagle3_head(path, target)
    assert head.config.source == "specforge"
    ids, note = eagle3.aux_hidden_states(head.config, 8)
    assert ids == expected and f"{written} read as {rule} does" in note
    assert ("under eagle_config" if where == "eagle_config" else "at the top level") in note
    legacy, _ = eagle3.aux_hidden_states(head.config, 8, "sglang-legacy")  # SGLang before PR #25454
    assert legacy == tuple(k + 1 for k in written)
    ids, note = eagle3.aux_hidden_states(head.config, 8, "vllm")
    assert ids == tuple(written) and "given by --aux-layer-reading" in note
    with pytest.raises(UserError, match="--aux-layer-reading bogus"):
        eagle3.aux_hidden_states(head.config, 8, "bogus")


def test_training_length_rule(target, tmp_path):
    # SpecForge config with the target's context and no training record: refused, with the reason
    path = write_eagle(tmp_path / "long", "specforge-qwen3-235b-a22b-eagle3",
                       edit=lambda d: d.__setitem__("max_position_embeddings", 131072))
    from calibrate.drafters.checkpoint import training_length
    t = training_length(path, 131072, trust_mpe=True)
    drafter = eagle3.Eagle3Adapter(eagle3.load_eagle3_head(path, target), target, None, training=t)
    with pytest.raises(UserError, match=rf"max_position_embeddings 131072 is not below {MPE_TRUST_LIMIT}.*pass --n-ref"):
        drafter.default_n_ref
    # a SpecForge recipe beside it states the length
    (path / "recipe.yaml").write_text("data:\n  max_length: 4096\n")
    assert training_length(path, 131072, trust_mpe=True).value == 4096
    # speculators copies the target's context: never trusted, even when small
    assert training_length(tmp_path, 2048, trust_mpe=False).value is None
    assert training_length(tmp_path, 2048, trust_mpe=True).value == 2048


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.__setitem__("logit_softcap", 30.0), "field 'logit_softcap' is not understood"),
    (lambda d: d.__setitem__("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}),
     "'dynamic' is not supported.*run time"),
    (lambda d: d.__setitem__("rope_scaling", {"rope_type": "mrope", "mrope_section": [2, 3, 3], "mrope_interleaved": 1}),
     "mrope needs mrope_section.*'mrope_interleaved'"),
    (lambda d: d["rope_scaling"].pop("original_max_position_embeddings"),
     "needs 'original_max_position_embeddings'; transformers would use max_position_embeddings"),
    (lambda d: d.__setitem__("architectures", ["Eagle3DeepseekV2ForCausalLM"]), "not an EAGLE-3 head this loader"),
])
def test_what_could_change_the_computation_is_refused(edit, message, target, tmp_path):
    d = shrink_eagle("specforge-llama3-70b-eagle3-llama3rope", 256)
    edit(d)
    with pytest.raises(UserError, match=message):
        Eagle3Config.from_dict(d)


def test_unknown_weight_is_refused(target, tmp_path):
    path = write_eagle(tmp_path / "w", "specforge-qwen3-30b-a3b-eagle3.1")
    from safetensors.torch import load_file
    state = load_file(str(path / "model.safetensors"))
    state["midlayer.self_attn.g_proj.weight"] = torch.zeros(64, 64)
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(UserError, match="weight 'midlayer.self_attn.g_proj.weight' is not part of"):
        eagle3.load_eagle3_head(path, target)


def test_fc_norm_changes_the_queries(target, tokens, tmp_path):
    """EAGLE 3.1's per-feature norms are applied: dropping them changes q."""
    path = write_eagle(tmp_path / "h", "specforge-qwen3-30b-a3b-eagle3.1")
    head = eagle3.load_eagle3_head(path, target)
    feats = eagle3.target_features(target, tokens)
    assert not torch.allclose(head.combine(feats), feats)


# ---------------------------------------------------------------------------------------------
# DFlash formats
# ---------------------------------------------------------------------------------------------

def visible_keys_of(d: dict, layer: int, p: int, j: int) -> list[int]:
    """Keys block row ``j`` at ``p`` sees (docs/drafters.md, the window rule): all ``p + b`` in a full layer; in a
    sliding layer SpecForge's training mask (create_dflash_sdpa_mask): context keys c < p with
    c >= p + j - (W - 1), and block keys p .. p + j, which the window does not cut."""
    inner = d.get("transformer_layer_config", d)
    b = d.get("block_size", 16)
    if (inner.get("layer_types") or ["full_attention"] * 99)[layer] == "full_attention":
        return list(range(p + b))
    return [c for c in range(p) if c >= p + j - (inner["sliding_window"] - 1)] + list(range(p, p + j + 1))


def reference_dflash(d: dict, state: dict, hs, tokens, p: int, embed, h_ids):
    """Float64 DFlash block at position ``p`` (z-lab dflash/model.py math, docs/drafters.md):
    per layer the post-RoPE q (b, heads, D) and k (p + b, kv, D), and the block output.

    ctx = hidden_norm(fc(cat h[id])) at positions 0..p-1; block = embed(anchor, mask...) at p..p+b-1;
    q = RoPE(q_norm(q_proj(x))), k = RoPE(k_norm(k_proj(cat(ctx, x)))), x = input_layernorm(h);
    block row j sees the keys of :func:`visible_keys_of`.
    """
    inner = d.get("transformer_layer_config", d)
    eps, b = inner["rms_norm_eps"], d.get("block_size", 16)
    heads, kv, hd = inner["num_attention_heads"], inner["num_key_value_heads"], inner["head_dim"]
    mask_id = (d.get("dflash_config") or d)["mask_token_id"]
    w = {k: v.double() for k, v in state.items()}
    ctx = rms(torch.cat([hs[i][0, :p].double() for i in h_ids], -1) @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    block = torch.tensor([int(tokens[0, p])] + [mask_id] * (b - 1))
    h = embed[block].double()
    params, theta = rope_of(inner)

    def rot(x, pos):
        return rotate(x, pos, params, theta)

    seen = []
    for i in range(inner["num_hidden_layers"]):
        lw = {k[len(f"layers.{i}."):]: v for k, v in w.items() if k.startswith(f"layers.{i}.")}
        x = rms(h, lw["input_layernorm.weight"], eps)
        kv_in = torch.cat((ctx, x))
        q = rot(rms((x @ lw["self_attn.q_proj.weight"].T).view(b, heads, hd), lw["self_attn.q_norm.weight"], eps),
                torch.arange(p, p + b))
        k = rot(rms((kv_in @ lw["self_attn.k_proj.weight"].T).view(p + b, kv, hd), lw["self_attn.k_norm.weight"], eps),
                torch.arange(p + b))
        v = (kv_in @ lw["self_attn.v_proj.weight"].T).view(p + b, kv, hd)
        seen.append((q, k))
        hidden = torch.ones(b, p + b, dtype=torch.bool)
        for j in range(b):
            hidden[j, visible_keys_of(d, i, p, j)] = False
        out = torch.stack([torch.softmax(((q[:, j] @ k[:, j * kv // heads].T) * hd ** -0.5).masked_fill(hidden, -math.inf),
                                         -1) @ v[:, j * kv // heads] for j in range(heads)], 1)
        h = h + out.reshape(b, -1) @ lw["self_attn.o_proj.weight"].T
        m = rms(h, lw["post_attention_layernorm.weight"], eps)
        h = h + (torch.nn.functional.silu(m @ lw["mlp.gate_proj.weight"].T) * (m @ lw["mlp.up_proj.weight"].T)
                 ) @ lw["mlp.down_proj.weight"].T
    return seen, rms(h, w["norm.weight"], eps)


def collect_calls(drafter, tokens, p):
    calls = []
    drafter.collect(tokens, lambda *a: calls.append(a), torch.tensor([p]))
    return calls


def only_rope_parameters(path: Path, theta: float) -> dict:
    """Rewrite a z-lab DFlash config.json transformers-5 style: RoPE only in ``rope_parameters``."""
    cfg = json.loads((path / "config.json").read_text())
    del cfg["rope_theta"], cfg["rope_scaling"]
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    (path / "config.json").write_text(json.dumps(cfg))
    return cfg


def test_dflash_with_only_rope_parameters_matches_its_reference(target, tokens, tmp_path, p=11):
    """theta 1e6 from rope_parameters reaches the post-RoPE queries and keys (not 10000)."""
    from safetensors.torch import load_file

    from calibrate.drafters.dflash import DFlashAdapter, load_dflash
    path = write_tiny_dflash(tmp_path / "dflash", target, seed=3, target_layer_ids=(1, 3, 5))
    d = only_rope_parameters(path, 1e6)
    model = load_dflash(path, target)
    assert model.config.rope_theta == 1e6
    calls = collect_calls(DFlashAdapter(model, target, tokenizer=None), tokens, p)
    state = load_file(str(path / "model.safetensors"))
    with torch.no_grad():
        hs = target(tokens, output_hidden_states=True).hidden_states
    embed = target.get_input_embeddings().weight.detach()
    seen, _ = reference_dflash(d, state, hs, tokens, p, embed, (2, 4, 6))
    d_default = {**d, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    seen_default, _ = reference_dflash(d_default, state, hs, tokens, p, embed, (2, 4, 6))
    assert [c[0] for c in calls] == [0, 1]
    for (layer, q, k, _, n_visible), (q_ref, k_ref), (q_def, _) in zip(calls, seen, seen_default):
        assert torch.equal(n_visible, torch.full((1, 4), p + 4))
        # fp32 model vs float64 reference, O(1) activations through 2 layers: ~1e-6 per op
        assert torch.allclose(q[0].transpose(0, 1).double(), q_ref, atol=1e-4)
        assert torch.allclose(k[0].transpose(0, 1).double(), k_ref, atol=1e-4)
        assert not torch.allclose(q_ref, q_def, atol=1e-2)  # the base matters at these positions


# aux ids for the tiny 8-layer target: z-lab / SpecForge name layers (read h[k + 1]), speculators h-indices
DFLASH_IDS = {"specforge-qwen3.6-27b-dflash-swa": [0, 1, 3, 4, 6],
              "speculators-dflash-qwen3.6-35b-a3b-converted-yarn": [1, 2, 4, 5, 7]}


def shrink_dflash(name: str, vocab: int) -> dict:
    """The real DFlash config shrunk to the tiny target's (``shrink_decoder``), with ids for its 8 layers."""
    d = shrink_decoder(name, vocab)
    if "speculators_model_type" in d:
        d.update(mask_token_id=vocab - 1, draft_vocab_size=vocab, aux_hidden_state_layer_ids=DFLASH_IDS[name])
    else:
        d["num_target_layers"] = 8
        d["dflash_config"].update(mask_token_id=vocab - 1, target_layer_ids=DFLASH_IDS[name])
    return d


def write_dflash(directory: Path, name: str, vocab: int = 256, seed: int = 0) -> Path:
    """A random DFlash model for the shrunk config ``name`` in its project's key layout (docs/drafters.md:
    speculators adds its own embed_tokens and lm_head to z-lab's keys)."""
    from calibrate.drafters.dflash import DFlashConfig, DFlashDraftModel
    d = shrink_dflash(name, vocab)
    with torch.device("meta"):
        model = DFlashDraftModel(DFlashConfig.from_dict(copy.deepcopy(d)))
    g = torch.Generator().manual_seed(seed)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    if "speculators_model_type" in d:
        shapes.update({"embed_tokens.weight": (vocab, 64), "lm_head.weight": (vocab, 64)})
    state = {key: 1.0 + 0.1 * torch.randn(shape, generator=g) if len(shape) == 1
             else torch.randn(shape, generator=g) * shape[-1] ** -0.5 for key, shape in sorted(shapes.items())}
    layers = d.get("transformer_layer_config", d)["num_hidden_layers"]
    assert set(state) - {"embed_tokens.weight", "lm_head.weight"} == {"fc.weight", "hidden_norm.weight", "norm.weight", *(
        f"layers.{i}.{k}.weight" for i in range(layers) for k in (
            "input_layernorm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
            *(f"self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"))))}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(d, indent=2))
    save_file(state, str(directory / "model.safetensors"))
    return directory


@pytest.mark.parametrize("p", [3, 15])  # rows inside the window only, then rows with a full window too
def test_sliding_window_dflash_matches_its_reference(p, target, tokens, tmp_path):
    """SpecForge's Qwen3.6-27B recipe (4 sliding layers, W shrunk to 8, then 1 full layer): each tap
    call hands a row exactly the keys it sees, as the first n_visible, and the block output matches."""
    from safetensors.torch import load_file

    from calibrate.drafters.dflash import DFlashAdapter, load_dflash
    name = "specforge-qwen3.6-27b-dflash-swa"
    path = write_dflash(tmp_path / "swa", name)
    d = json.loads((path / "config.json").read_text())
    model = load_dflash(path, target)
    drafter = DFlashAdapter(model, target, tokenizer=None)
    assert "sliding-window layers [0, 1, 2, 3] (W = 8) use SpecForge's training mask" in " ".join(drafter.notes)
    state = load_file(str(path / "model.safetensors"))
    with torch.no_grad():
        hs = target(tokens, output_hidden_states=True).hidden_states
    embed = target.get_input_embeddings().weight.detach()
    h_ids = [k + 1 for k in DFLASH_IDS[name]]
    seen, out_ref = reference_dflash(d, state, hs, tokens, p, embed, h_ids)
    feats = torch.cat([hs[i] for i in h_ids], -1)
    block = torch.tensor([[int(tokens[0, p])] + [255] * 15])
    for impl in ("sdpa", "eager"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            out = model(embed[block], feats[:, :p], torch.arange(p + 16)[None])[0].double()
        assert torch.allclose(out, out_ref, atol=1e-4)  # fp32 vs float64 through 5 layers, O(1) activations
    model.set_attn_implementation("sdpa")
    calls = collect_calls(drafter, tokens, p)
    for layer, (q_ref, k_ref) in enumerate(seen):
        mine = [c for c in calls if c[0] == layer]
        rows = torch.cat([c[1] for c in mine], dim=2)[0].transpose(0, 1).double()  # (16, heads, D), rows in order
        assert torch.allclose(rows, q_ref, atol=1e-4)
        j = 0
        for _, q, k, _, n_visible in mine:
            for r in range(q.shape[2]):
                keys = visible_keys_of(d, layer, p, j)
                assert int(n_visible[0, r]) == len(keys)  # the count the attention function passed
                assert torch.allclose(k[0, :, :len(keys)].transpose(0, 1).double(), k_ref[keys], atol=1e-4)
                j += 1
        assert j == 16
        starts = {visible_keys_of(d, layer, p, j)[0] for j in range(16)}  # one call per first visible key
        assert len(mine) == len(starts) and (layer == 4 or len(starts) > 1)


def test_sliding_window_statistics_use_the_visible_keys(target, tokens, tmp_path, p=15):
    """RowCollector's statistics of a sliding layer's rows equal those of the keys each row sees."""
    from calibrate.collect import RowCollector
    from calibrate.drafters.dflash import DFlashAdapter, load_dflash
    from sharpdraft_theory.stats import row_stats_from_logits
    path = write_dflash(tmp_path / "swa", "specforge-qwen3.6-27b-dflash-swa")
    drafter = DFlashAdapter(load_dflash(path, target), target, tokenizer=None)
    calls = collect_calls(drafter, tokens, p)
    collector = RowCollector([WINDOW], k_max=4)
    collector.start(0)
    drafter.collect(tokens, collector, torch.tensor([p]))
    stats = collector.take()
    sliding = stats.layer < 4
    assert set(stats.n[sliding].tolist()) == {WINDOW} and set(stats.n[~sliding].tolist()) == {p + 16}  # full: a block
    # layer 0, head 0, block rows with a full window: logits over their own W keys, in float64
    rows = [(q, k) for layer, q, k, _, n in calls if layer == 0 and int(n[0, 0]) == WINDOW]
    logits = torch.stack([(q[0, 0, 0].double() @ k[0, 0, :WINDOW].double().T) * 16 ** -0.5 for q, k in rows])
    ref = row_stats_from_logits(logits.numpy(), k_max=4, alpha_grid=stats.alpha_grid)
    mine = (stats.layer == 0) & (stats.head == 0)
    assert mine.sum() == len(rows)
    # fp32 reduction vs float64 reference: ~1e-6 relative on O(1) logits
    assert torch.allclose(torch.as_tensor(stats.lse[mine]).double(), torch.as_tensor(ref.lse), atol=1e-4)


def test_speculators_dflash_matches_its_reference(target, tokens, tmp_path, p=9):
    """z-lab's Qwen3.6-35B-A3B head converted by speculators: aux ids are hidden-state indices already,
    yarn RoPE (factor 64, theta 1e7: a = 0.1 ln 64 + 1 on cos and sin), its own embed_tokens."""
    from safetensors.torch import load_file

    from calibrate.drafters.dflash import DFlashAdapter, load_dflash
    name = "speculators-dflash-qwen3.6-35b-a3b-converted-yarn"
    path = write_dflash(tmp_path / "spec", name)
    d = json.loads((path / "config.json").read_text())
    model = load_dflash(path, target)
    c = model.config
    assert (c.source, c.hidden_state_ids, c.rope_theta, c.rope_scaling.rope_type) == (
        "speculators", (1, 2, 4, 5, 7), 1e7, "yarn")
    drafter = DFlashAdapter(model, target, tokenizer=None)
    assert "reads target hidden_states [1, 2, 4, 5, 7]: aux_hidden_state_layer_ids are hidden-state indices" in \
        drafter.notes[0]
    calls = collect_calls(drafter, tokens, p)
    state = load_file(str(path / "model.safetensors"))
    with torch.no_grad():
        hs = target(tokens, output_hidden_states=True).hidden_states
    seen, _ = reference_dflash(d, state, hs, tokens, p, state["embed_tokens.weight"], (1, 2, 4, 5, 7))
    assert [call[0] for call in calls] == list(range(8))
    for (_, q, k, _, n_visible), (q_ref, k_ref) in zip(calls, seen):
        assert torch.equal(n_visible, torch.full((1, 16), p + 16))
        # fp32 model vs float64 reference through 8 layers, q and k times a = 1.42: ~1e-6 per op
        assert torch.allclose(q[0].transpose(0, 1).double(), q_ref, atol=1e-4)
        assert torch.allclose(k[0].transpose(0, 1).double(), k_ref, atol=1e-4)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["transformer_layer_config"].__setitem__("layer_types", ["sliding_attention"] * 8),
     "count the window back from the block's anchor"),
    (lambda d: d.__setitem__("speculators_model_type", "dspark"), "speculators' DSpark"),
    (lambda d: d.__setitem__("aux_hidden_state_layer_ids", [1, 2, 4, 5, 8]), r"aux_hidden_state_layer_ids \[1, 2, 4, 5, 8\]"),
    (lambda d: d["transformer_layer_config"].__setitem__("attn_logit_softcapping", 50.0),
     "transformer_layer_config: config.json field 'attn_logit_softcapping' is not understood"),
])
def test_speculators_dflash_refusals(edit, message, target, tmp_path):
    from calibrate.drafters.dflash import load_dflash
    path = write_dflash(tmp_path / "spec", "speculators-dflash-qwen3.6-35b-a3b-converted-yarn")
    d = json.loads((path / "config.json").read_text())
    edit(d)
    (path / "config.json").write_text(json.dumps(d))
    with pytest.raises(UserError, match=message):
        load_dflash(path, target)


# ---------------------------------------------------------------------------------------------
# end to end: sharpdraft calibrate
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def disk_target(tmp_path_factory):
    root = tmp_path_factory.mktemp("target")
    model = tiny_target(0, vocab_size=VOCAB)
    model.save_pretrained(root)
    _write_tokenizer(root)
    return root, model


def _calibrate(tmp_path, kind, path, target_dir, *extra):
    out = tmp_path / "spec.json"
    res = CliRunner().invoke(app, ["calibrate", "--drafter", kind, "--drafter-path", str(path), "--target-path",
                                   str(target_dir), "--max-length", "256", "--sequences", "1", "--device", "cpu",
                                   "--out", str(out), *extra], terminal_width=250)
    return res, out


@pytest.mark.parametrize("name", ["speculators-eagle3-mistral123b-yarn", "specforge-qwen3-30b-a3b-eagle3.1",
                                  "specforge-llama3-70b-eagle3-llama3rope"])
def test_cli_calibrates_released_eagle_heads(name, disk_target, tmp_path):
    target_dir, _ = disk_target
    path = write_eagle(tmp_path / "head", name, vocab=VOCAB)
    res, out = _calibrate(tmp_path, "eagle3", path, target_dir, "--n-ref", "64")
    assert res.exit_code == 0, res.output
    source = name.split("-")[0]
    assert f"EAGLE-3 head in {source}'s layout" in res.output and out.is_file()


def test_cli_calibrates_a_dflash_head_with_only_rope_parameters(disk_target, tmp_path):
    target_dir, model = disk_target
    path = write_tiny_dflash(tmp_path / "dflash", model, seed=3, target_layer_ids=(1, 3, 5))
    only_rope_parameters(path, 1e6)
    from calibrate.drafters.dflash import DFlashConfig
    assert DFlashConfig.from_json(path / "config.json").rope_theta == 1e6
    res, _ = _calibrate(tmp_path, "dflash", path, target_dir, "--n-ref", "64")
    assert res.exit_code == 0, res.output


def test_cli_refuses_an_untrustworthy_default_n_ref(disk_target, tmp_path):
    target_dir, _ = disk_target
    path = write_eagle(tmp_path / "head", "specforge-qwen3-235b-a22b-eagle3", vocab=VOCAB,
                       edit=lambda d: d.__setitem__("max_position_embeddings", 131072))
    res, _ = _calibrate(tmp_path, "eagle3", path, target_dir)  # CliRunner sees the UserError main() prints
    assert isinstance(res.exception, UserError)
    assert "max_position_embeddings 131072 is not below 16384" in str(res.exception) and "--n-ref" in str(res.exception)
    res, _ = _calibrate(tmp_path, "eagle3", path, target_dir, "--aux-layer-reading", "nope", "--n-ref", "64")
    assert isinstance(res.exception, UserError) and "--aux-layer-reading nope" in str(res.exception)
    res, _ = _calibrate(tmp_path, "eagle3", path, target_dir, "--n-ref", "64")
    assert res.exit_code == 0, res.output
    assert "reads target hidden_states [2, 4, 6]: aux layer ids [1, 3, 5] read as sglang" in " ".join(res.output.split())


# ---------------------------------------------------------------------------------------------
# second pass: fields read where they were ignored or misread
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spelling", ["top", "rope_parameters"])
def test_partial_rotary_factor_rotates_the_first_fraction(spelling, target, tokens, tmp_path):
    """partial_rotary_factor 0.5 (either transformers spelling): RoPE on the first 8 of 16 dimensions, as vLLM and
    SGLang compute it; full RoPE (the old reading) differs on the last 8."""
    def edit(d):
        if spelling == "top":
            d["partial_rotary_factor"] = 0.5
        else:
            d["rope_parameters"] = {"rope_type": "default", "rope_theta": d.pop("rope_theta", 10000.0),
                                    "partial_rotary_factor": 0.5}
            d.pop("rope_scaling", None)
    name = "specforge-qwen3-30b-a3b-eagle3.1"
    path = write_eagle(tmp_path / "h", name, edit=edit)
    head = eagle3.load_eagle3_head(path, target)
    assert head.config.rotary_dim == 8
    calls = []
    eagle3.Eagle3Adapter(head, target, None).collect(tokens, lambda *a: calls.append(a), torch.tensor([5]))
    (_, q, k, _, _), = calls
    d = json.loads((path / "config.json").read_text())
    from safetensors.torch import load_file
    state = {**load_file(str(path / "model.safetensors")), "embed_tokens.weight": target.get_input_embeddings().weight}
    with torch.no_grad():
        hs = target(tokens, output_hidden_states=True).hidden_states
    q_ref, k_ref = reference_qk(d, state, hs, tokens, (2, 4, 5))
    # fp32 head vs float64 reference, O(1) activations: ~1e-6 per op
    assert torch.allclose(q[0].transpose(0, 1).double(), q_ref, atol=1e-4)
    assert torch.allclose(k[0].transpose(0, 1).double(), k_ref, atol=1e-4)
    full = {**d, "partial_rotary_factor": 1.0, "rope_parameters": None}
    q_full, _ = reference_qk(full, state, hs, tokens, (2, 4, 5))
    assert not torch.allclose(q_ref, q_full, atol=1e-2)  # this test can fail: the fraction changes q


def test_partial_rotary_spellings_must_agree_and_dflash_refuses_it(tmp_path):
    d = shrink_eagle("specforge-qwen3-30b-a3b-eagle3.1", 256)
    d.update(partial_rotary_factor=0.5, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                         "partial_rotary_factor": 0.25})
    with pytest.raises(UserError, match="partial_rotary_factor disagrees"):
        Eagle3Config.from_dict(d)
    from calibrate.drafters.dflash import DFlashConfig
    d = json.loads(json.dumps(real_config("specforge-qwen3.6-27b-dflash-swa")))
    d["partial_rotary_factor"] = 0.25
    with pytest.raises(UserError, match="partial_rotary_factor 0.25 is not supported for DFlash"):
        DFlashConfig.from_dict(d)


def test_specforge_norm_output_false_drops_the_final_norm(target, tokens, tmp_path):
    """SpecForge's compute_logits: lm_head(norm(o)) when norm_output (default), lm_head(o) when false."""
    name = "specforge-qwen3-30b-a3b-eagle3.1"
    path = write_eagle(tmp_path / "h", name, edit=lambda d: d.__setitem__("norm_output", False))
    head = eagle3.load_eagle3_head(path, target)
    with torch.no_grad():
        out = head(tokens[:, 1:], eagle3.target_features(target, tokens)[:, :-1])
        o, w = out.hidden_states.double(), head.lm_head.weight.double()  # o: the fed-back pre-norm state
        normed = head.norm(out.hidden_states).double()
    # fp32 lm_head vs float64 product over 64 O(1) terms: ~1e-6
    assert torch.allclose(out.logits.double(), o @ w.T, atol=1e-4)
    assert not torch.allclose(out.logits.double(), normed @ w.T, atol=1e-2)  # the old reading (norm applied)
    assert head.config.final_norm is False and head.config.norm_output is False


def test_n_ref_threshold_is_exclusive(tmp_path):
    from calibrate.drafters.checkpoint import training_length
    assert training_length(tmp_path, MPE_TRUST_LIMIT - 1, trust_mpe=True).value == MPE_TRUST_LIMIT - 1
    t = training_length(tmp_path, MPE_TRUST_LIMIT, trust_mpe=True)  # SpecForge's Phi-4 head: Phi-4's context
    assert t.value is None and f"is not below {MPE_TRUST_LIMIT}" in t.origin


def test_dflash_reads_its_training_record(target, tmp_path):
    from calibrate.drafters.checkpoint import training_length
    from calibrate.drafters.dflash import DFLASH_DEFAULT_N_REF, load_dflash
    path = write_dflash(tmp_path / "swa", "specforge-qwen3.6-27b-dflash-swa")
    model = load_dflash(path, target)
    plain = DFlashAdapter(model, target, None, training=training_length(path, 262144, trust_mpe=False))
    assert plain.default_n_ref == DFLASH_DEFAULT_N_REF and "copies max_position_embeddings" in plain.notes[-1]
    (path / "recipe.yaml").write_text("data:\n  max_length: 4096\n")
    drafter = DFlashAdapter(model, target, None, training=training_length(path, 262144, trust_mpe=False))
    assert drafter.default_n_ref == 4096 and "data.max_length 4096" in " ".join(drafter.notes)


def test_pard2_is_refused_by_name(tmp_path):
    from calibrate.drafters.hf import load
    for config in ({"pard2": True, "pard_token": 3}, {"spd_type": "pard2"}):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", **config}))
        with pytest.raises(UserError, match="field 'pard2' is not supported by the PARD loader: PARD-2 adds a "
                                            "projection of the target's hidden states"):
            load("pard", str(tmp_path), None, torch.device("cpu"), torch.float32)


def test_cli_calibrates_a_speculators_head_with_older_serialisation_fields(disk_target, tmp_path):
    """speculators < 0.8 wrote its config class variables (has_no_defaults_at_init, base_model_ep_plan): harmless."""
    target_dir, _ = disk_target
    def edit(d):
        d.update(has_no_defaults_at_init=False, base_model_ep_plan=None, base_model_tp_plan=None)
    path = write_eagle(tmp_path / "head", "speculators-eagle3-mistral123b-yarn", vocab=VOCAB, edit=edit)
    res, out = _calibrate(tmp_path, "eagle3", path, target_dir, "--n-ref", "64")
    assert res.exit_code == 0, res.output
    assert out.is_file()
