"""DFlash block-diffusion drafter: a faithful, self-contained PyTorch module for z-lab/dflash's layout.

DFlash (z-lab, "DFlash: Block Diffusion for Flash Speculative Decoding", arXiv:2602.06036) drafts a
whole block in one forward. The target's hidden states at ``target_layer_ids`` (transformers'
``hidden_states[id + 1]``, the *output* of layer ``id``) are concatenated and fused once::

    c_j = hidden_norm(fc(cat(h_{id+1}[j] for id in target_layer_ids)))     # context feature, (H,)

A block at position ``p`` is the anchor token ``x_p`` followed by ``block_size - 1`` mask tokens,
embedded with the *target's* embedding, at RoPE positions ``p .. p + block_size - 1``. Each of the
drafter's layers is a Qwen3-style decoder layer whose attention takes queries from the block and
keys / values from ``cat(context, block)``::

    q = RoPE(q_norm(q_proj(x)))                  # per head, norm before RoPE
    k = RoPE(k_norm(k_proj(cat(c_0..c_{p-1}, x))))  # the context uses positions 0 .. p-1
    full layers are non-causal: every block query sees all p context keys and the whole block;
    sliding layers (layer_types) see a causal window of W keys (DFlashDraftModel.visible_mask)

The context keys depend only on ``c`` (not on the layer's input), so they are computed once per
sequence and shared by all blocks (:meth:`DFlashDraftModel.encode_context`), just as DFlash's own
KV cache keeps them between steps. The output goes through ``norm`` and the target's ``lm_head``.

Attention is dispatched through transformers' ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``
(default ``"sdpa"``; ``"eager"`` is a plain-math path) with the signature
``fn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs)``; ``module``
has ``layer_idx`` and ``is_causal = False``, so a registered function sees post-RoPE queries and
keys (and may scale the queries), and ``sharpdraft_runtime.visible_keys`` counts every key as
visible to every block query in a full layer, as the non-causal attention without a mask
computes, and the keys the window's mask leaves in a sliding layer.
Checked against z-lab/dflash ``dflash/model.py``; ``docs/drafters.md`` lists what was verified.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import nn

from sharpdraft_theory.spec import DrafterInfo

from ..errors import UserError
from ..taps import attention_tap
from .base import AttentionTap
from .checkpoint import TrainingLength, build, config_field, read_config, read_weights, training_length
from .fields import check_fields
from .layers import (GatedMLP, RMSNorm, RopeScaling, apply_rope, attention, read_partial_rotary, read_rope, rope_cos_sin,
                     rope_inv_freq)
from .target import eos_token_id, hidden_state_features, load_target

__all__ = ["DFlashConfig", "DFlashDraftModel", "DFlashAdapter", "load", "load_dflash", "context_features",
           "DFLASH_DEFAULT_N_REF", "DFLASH_HEAD_DIR"]

# DFlash's config.json states no training length (max_position_embeddings is copied from the target); without a
# training record beside the checkpoint, 3072, SpecForge's DFlash recipe max_length [unconfirmed for z-lab's own].
DFLASH_DEFAULT_N_REF = 3072
DFLASH_HEAD_DIR = Path(__file__).resolve().parent.parent / "assets" / "dflash-smollm2"  # built-in, for SmolLM2

_SECTION = "dflash_config"  # DFlash draft fields may sit here or at the top level of config.json
_field = partial(config_field, what="DFlash")
# SpecForge's DFlash-backbone variants (docs/drafters.md): the attention is DFlash's, unchanged; each adds a
# logit term from heads with these weight prefixes (their config fields: calibrate.drafters.fields), and
# requires dflash_config.projector_type to be its own value (specforge/modeling/draft/dspark.py, domino.py)
_VARIANTS = {
    "DSparkDraftModel": ("DSpark", "Markov and confidence heads", ("markov_head.", "confidence_head."), "dspark"),
    "DominoDraftModel": ("Domino", "GRU logit correction", ("prefix_gru.", "embed_proj."), "domino"),
}


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------

@dataclass
class DFlashConfig:
    """Shape and constants of a DFlash draft model, read from its ``config.json``.

    Like a transformers config it carries ``_attn_implementation``, the name every attention layer
    looks up in ``ALL_ATTENTION_FUNCTIONS`` (set it with ``DFlashDraftModel.set_attn_implementation``).
    """

    hidden_size: int  # drafter width H
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # key/value heads
    intermediate_size: int  # MLP width
    num_hidden_layers: int  # drafter layers
    vocab_size: int  # the target's vocabulary (embedding and lm_head are the target's)
    block_size: int  # anchor + block_size - 1 mask tokens
    mask_token_id: int  # token id of the mask token
    target_layer_ids: tuple[int, ...]  # aux layer ids as written (hidden_state_ids says what they read)
    head_dim: int = 0  # width of one head; 0 in the constructor means hidden_size // heads
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon (layer norms and q_norm / k_norm)
    rope_theta: float = 10000.0  # RoPE base (transformers' Qwen3 default when absent)
    rope_scaling: RopeScaling | None = None  # linear / llama3 / yarn frequency scaling; None = plain RoPE
    target_hidden_size: int = 0  # target width; 0 in the constructor means hidden_size
    num_target_layers: int | None = None  # recorded by DFlash; checked against the target when present
    attention_bias: bool = False  # q/k/v/o biases
    input_embedding_scale: float = 1.0  # block embeddings are multiplied by this (DFlash option)
    max_position_embeddings: int | None = None  # recorded only (copied from the target by DFlash)
    # z-lab layout: rows of the target's lm_head the head drafts from (weight ``d2t``: row i is target id
    # i + d2t[i], EAGLE-3's map); None: the whole vocabulary. Speculators' is its own lm_head's (not run).
    draft_vocab_size: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" or "sliding_attention"; () = all full
    sliding_window: int | None = None  # W of the sliding layers (SpecForge / vLLM rule, visible_mask); None = none
    source: str = "dflash"  # layout: "dflash" (z-lab / SpecForge) or "speculators" (vLLM speculators, converted)
    variant: str = "DFlashDraftModel"  # architecture: DFlash, or a _VARIANTS key run as DFlash (its logit heads not)
    _attn_implementation: str = field(default="sdpa", compare=False, repr=False)  # attention dispatch name

    def __post_init__(self):
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if not self.target_hidden_size:
            object.__setattr__(self, "target_hidden_size", self.hidden_size)

    @property
    def hidden_state_ids(self) -> tuple[int, ...]:
        """Target ``hidden_states`` indices fed to ``fc``: z-lab's ``target_layer_ids`` name layers whose
        output is read (``id + 1``); speculators' ``aux_hidden_state_layer_ids`` are the indices already."""
        return tuple(i + (self.source == "dflash") for i in self.target_layer_ids)

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "DFlashConfig":
        """Read the fields DFlash uses; raise UserError naming a missing, malformed or unsupported field,
        or one this loader does not read and that is not known to be harmless (``calibrate.drafters.fields``)."""
        source, ids_field = "dflash", "target_layer_ids"
        if "speculators_model_type" in d:
            d, source, ids_field = _speculators_flat(d, where), "speculators", "aux_hidden_state_layer_ids"
        if not isinstance(d.get(_SECTION) or {}, dict):
            raise UserError(f"{where}: config.json field '{_SECTION}' should be an object, got {d[_SECTION]!r}")
        arch = d.get("architectures") or ()
        section = d.get(_SECTION) or {}
        variant = next((a for a in arch if a in _VARIANTS), "DFlashDraftModel")
        projector = section.get("projector_type")
        if projector is not None and (variant not in _VARIANTS or projector != _VARIANTS[variant][3]):
            raise UserError(f"{where}: dflash_config.projector_type {projector!r} with architectures {list(arch)}: "
                            f"SpecForge knows 'dspark' (DSparkDraftModel) and 'domino' (DominoDraftModel) only")
        mode = section.get("attention_mode", "gqa")
        if mode not in ("gqa", "mha"):
            raise UserError(f"{where}: dflash_config.attention_mode {mode!r} is not supported (gqa or mha: "
                            f"DFlash's attention)")
        if any("DFlash2" in a for a in arch):
            raise UserError(f"{where}: {d['architectures']} (DFlash2, with convolutions and a candidate "
                            f"selector) is not supported; only DFlashDraftModel")
        if d.get("is_causal"):
            raise UserError(f"{where}: is_causal true (causal DFlash blocks) is not supported; DFlash blocks are "
                            f"non-causal")
        check_fields(d, "dflash", where)
        check_fields(section, "dflash", where, f"{_SECTION}.")
        if d.get("hidden_act", "silu") != "silu":
            raise UserError(f"{where}: hidden_act {d['hidden_act']!r} is not supported (DFlash uses 'silu')")
        if d.get("mlp_bias"):
            raise UserError(f"{where}: mlp_bias true is not supported (DFlash's MLP has no biases)")
        req = {n: _field(d, n, int, where, required=True) for n in
               ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers", "vocab_size")}
        heads = req["num_attention_heads"]
        kv = _field(d, "num_key_value_heads", int, where, default=heads)
        if heads <= 0 or kv <= 0 or heads % kv or (mode == "mha" and kv != heads):
            raise UserError(f"{where}: num_key_value_heads={kv} must divide num_attention_heads={heads}"
                            + (" and equal it (attention_mode mha)" if mode == "mha" else ""))
        bias = d.get("attention_bias", False)
        if not isinstance(bias, bool):
            raise UserError(f"{where}: config.json field 'attention_bias' should be true or false, got {bias!r}")
        theta, scaling = read_rope(d, where, "DFlash", mrope=False)
        if read_partial_rotary(d, where) != 1.0:
            raise UserError(f"{where}: partial_rotary_factor {read_partial_rotary(d, where)} is not supported for DFlash: "
                            f"z-lab's Qwen3 rotary rotates the whole head, so a partial one has no reference to follow")
        types, window = _layer_windows(d, where, req["num_hidden_layers"])
        draft_vocab = _field(d, "draft_vocab_size", int, where) if source == "dflash" else None
        if draft_vocab is not None and not 1 <= draft_vocab <= req["vocab_size"]:
            raise UserError(f"{where}: draft_vocab_size {draft_vocab} should be 1 to vocab_size = {req['vocab_size']}")
        return cls(
            **req, num_key_value_heads=kv,
            block_size=_field(d, "block_size", int, where, default=16, section=_SECTION),
            mask_token_id=_field(d, "mask_token_id", int, where, required=True, section=_SECTION),
            target_layer_ids=_field(d, ids_field, tuple, where, required=True, section=_SECTION),
            head_dim=_field(d, "head_dim", int, where, default=0),
            rms_norm_eps=_field(d, "rms_norm_eps", float, where, default=1e-6),
            rope_theta=theta, rope_scaling=scaling,
            target_hidden_size=_field(d, "target_hidden_size", int, where, default=0),
            num_target_layers=_field(d, "num_target_layers", int, where),
            attention_bias=bias,
            input_embedding_scale=_field(d, "input_embedding_scale", float, where, default=1.0, section=_SECTION),
            max_position_embeddings=_field(d, "max_position_embeddings", int, where),
            draft_vocab_size=draft_vocab, layer_types=types, sliding_window=window, source=source, variant=variant,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> "DFlashConfig":
        return cls.from_dict(read_config(path, "DFlash"), str(path))

    def to_dict(self, nested: bool = True) -> dict:
        """``config.json`` content in z-lab/dflash's layout (draft fields under ``dflash_config``
        when ``nested``, at the top level otherwise, as some checkpoints have them)."""
        if self.source != "dflash" or self.variant != "DFlashDraftModel":
            raise ValueError("to_dict writes z-lab's DFlash layout; this config comes from another")
        d = {
            "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "model_type": "qwen3", "hidden_act": "silu", "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_dict(),
            "attention_bias": self.attention_bias, "tie_word_embeddings": False,
        }
        if self.max_position_embeddings is not None:
            d["max_position_embeddings"] = self.max_position_embeddings
        if self.num_target_layers is not None:
            d["num_target_layers"] = self.num_target_layers
        if self.layer_types:
            d["layer_types"] = list(self.layer_types)
        if self.sliding_window is not None:
            d.update(use_sliding_window=True, sliding_window=self.sliding_window)
        if self.target_hidden_size != self.hidden_size:
            d["target_hidden_size"] = self.target_hidden_size
        if self.draft_vocab_size is not None:
            d["draft_vocab_size"] = self.draft_vocab_size
        draft = {"block_size": self.block_size, "mask_token_id": self.mask_token_id,
                 "target_layer_ids": list(self.target_layer_ids)}
        if nested:
            d["block_size"] = draft.pop("block_size")  # z-lab keeps block_size at the top level
            d["dflash_config"] = draft
        else:
            d.update(draft)
        return d


def _layer_windows(d: dict, where: str, num_layers: int) -> tuple[tuple[str, ...], int | None]:
    """``(layer_types, sliding_window)``: which layers slide, and their window ``W``.

    A ``sliding_window`` with no ``sliding_attention`` layer is the target's value copied over (no
    layer uses it). Refused: ``layer_types`` of the wrong length or with other types, and what
    transformers' ``Qwen3Config`` would reinterpret: ``use_sliding_window`` true without
    ``layer_types`` (it derives them from ``max_window_layers``), or sliding layers with
    ``use_sliding_window`` false (it drops ``sliding_window``).
    """
    types = d.get("layer_types")
    if types is None:
        if d.get("use_sliding_window") and d.get("sliding_window"):
            raise UserError(f"{where}: use_sliding_window true without layer_types: which layers slide is unclear "
                            f"(transformers would derive them from max_window_layers); write layer_types")
        return (), None
    if (not isinstance(types, list) or len(types) != num_layers
            or any(t not in ("full_attention", "sliding_attention") for t in types)):
        raise UserError(f"{where}: layer_types {types!r}: expected {num_layers} entries, each full_attention or "
                        f"sliding_attention")
    if "sliding_attention" not in types:
        return tuple(types), None
    if d.get("use_sliding_window") is False:
        raise UserError(f"{where}: layer_types has sliding_attention layers but use_sliding_window is false "
                        f"(transformers then drops sliding_window); which window applies is unclear")
    window = _field(d, "sliding_window", int, where, required=True)
    if window <= 0:
        raise UserError(f"{where}: sliding_window should be positive, got {window}")
    return tuple(types), window


def _speculators_flat(d: dict, where: str) -> dict:
    """A vLLM speculators DFlash config flattened: ``transformer_layer_config`` (the Qwen3 decoder)
    with the top-level draft fields over it, each level checked against the allow-lists first."""
    kind = d["speculators_model_type"]
    if kind != "dflash":
        hint = {"eagle3": " (use --drafter eagle3)",
                "dspark": " (speculators' DSpark: the key names of its Markov and confidence heads are not known "
                          "to this loader, so its weights cannot be checked)"}.get(kind, "")
        raise UserError(f"{where}: speculators_model_type {kind!r} is not a DFlash model this loader runs{hint}")
    inner = d.get("transformer_layer_config")
    if not isinstance(inner, dict):
        raise UserError(f"{where}: speculators config has no 'transformer_layer_config' object")
    if inner.get("model_type", "qwen3") != "qwen3":
        raise UserError(f"{where}: transformer_layer_config model_type {inner['model_type']!r} is not supported "
                        f"(speculators' DFlash decoder is qwen3)")
    check_fields(inner, "dflash", where + " transformer_layer_config")
    flat = {**inner, **{k: v for k, v in d.items() if k != "transformer_layer_config"}}
    if "sliding_attention" in (flat.get("layer_types") or ()):
        raise UserError(f"{where}: sliding-window layers in the speculators layout count the window back from the "
                        f"block's anchor (sliding_window_non_causal {flat.get('sliding_window_non_causal', False)}), "
                        f"a rule this loader does not implement; only SpecForge's and vLLM's")
    return flat


# ----------------------------------------------------------------------------------------------
# Attention dispatch
# ----------------------------------------------------------------------------------------------

def eager_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Plain-math attention with transformers' interface: returns ((B, q, heads, D), None).

    ``attention_mask`` is None (all keys visible) or a bool mask, True where a key is visible.
    """
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = attention(query, key, value, scaling, attention_mask, implementation="eager")
    return out.transpose(1, 2).contiguous(), None


def resolve_attention(name: str):
    """The attention function registered as ``name``; ``"eager"`` is the plain-math path above."""
    if name == "eager":
        return eager_attention
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    if name not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"attention implementation {name!r} is not registered with transformers' AttentionInterface")
    return ALL_ATTENTION_FUNCTIONS[name]


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------

class DFlashAttention(nn.Module):
    """Block queries over context + block keys, non-causal, with per-head q_norm / k_norm before RoPE."""

    is_causal = False  # read by transformers' sdpa function: no causal mask inside the block

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        c = config
        self.config, self.layer_idx = config, layer_idx
        self.num_key_value_groups = c.num_attention_heads // c.num_key_value_heads
        self.scaling = c.head_dim ** -0.5
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Post-norm, post-RoPE keys and values of ``x`` (B, n, H): each (B, kv_heads, n, D)."""
        B, n, _ = x.shape
        c = self.config
        key = self.k_norm(self.k_proj(x).view(B, n, c.num_key_value_heads, c.head_dim)).transpose(1, 2)
        value = self.v_proj(x).view(B, n, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        return apply_rope(key, cos, sin), value

    def forward(self, x, context, cos, sin, attention_mask=None, **kwargs):
        """x (B, q, H) normed block; context (key, value) each (B, kv_heads, p, D); cos/sin of the block."""
        B, q, _ = x.shape
        c = self.config
        query = self.q_norm(self.q_proj(x).view(B, q, c.num_attention_heads, c.head_dim)).transpose(1, 2)
        query = apply_rope(query, cos, sin)  # (B, heads, q, D)
        key, value = self.project_kv(x, cos, sin)
        key = torch.cat((context[0], key), dim=2)  # (B, kv_heads, p + q, D): context first, then block
        value = torch.cat((context[1], value), dim=2)
        fn = resolve_attention(c._attn_implementation)
        out, _ = fn(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(B, q, -1))  # out: (B, q, heads, D)


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, context, cos, sin, attention_mask=None, **kwargs):
        h = h + self.self_attn(self.input_layernorm(h), context, cos, sin, attention_mask, **kwargs)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftModel(nn.Module):
    """DFlash draft model with z-lab/dflash's parameter names (``fc``, ``hidden_norm``,
    ``layers.{i}.*``, ``norm``); the embedding and ``lm_head`` are the target's."""

    block_drafter = True  # non-causal blocks: sharpdraft_runtime.enable takes a scale-only spec on it (the block
    # drafter of calibrate.drafters.blocks runs windows, sinks and distance fixes)

    def __init__(self, config: DFlashConfig):
        super().__init__()
        c = config
        self.config = config
        self.fc = nn.Linear(len(c.target_layer_ids) * c.target_hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.embed_tokens: nn.Embedding | None = None  # the checkpoint's own (speculators); None: the target's
        if c.draft_vocab_size is not None:  # draft rows i + d2t[i] of the target's lm_head (z-lab layout only)
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self._draft_rows = None  # (key, ids, weight, bias): the lm_head rows of the draft vocabulary, made once

    def set_attn_implementation(self, name: str) -> None:
        """Dispatch attention to ``ALL_ATTENTION_FUNCTIONS[name]`` (or ``"eager"``, plain math)."""
        resolve_attention(name)
        self.config._attn_implementation = name

    def visible_mask(self, layer_idx: int, p: int, q_len: int, device=None) -> torch.Tensor | None:
        """Keys a block at ``p`` sees in layer ``layer_idx``: None (all ``p + q_len``: full layers)
        or a bool mask (1, 1, q_len, p + q_len), True where visible (sliding layers).

        Sliding layers follow SpecForge's training mask (``create_dflash_sdpa_mask`` in
        ``specforge/algorithms/common/dflash_family_model.py``; docs/drafters.md, the window rule):
        block row ``j`` (position ``p + j``) sees the context keys ``p + j - W + 1 .. p - 1`` (the row
        itself takes one slot of the window) and the block keys ``p .. p + j``, causal inside the block
        and never cut by the window. With ``j < W`` that is the causal window over absolute positions;
        a row past the window (``j >= W``, a window smaller than the block) still sees its ``j + 1``
        block keys. Either way the keys are contiguous, ``s_j .. p + j`` with
        ``s_j = min(p, max(0, p + j - W + 1))``. z-lab's transformers sdpa path would apply no window,
        and vLLM speculators counts it from the anchor.
        """
        c = self.config
        if not c.layer_types or c.layer_types[layer_idx] != "sliding_attention":
            return None
        row = torch.arange(q_len, device=device)[:, None]  # (q, 1) block offset j
        start = (p + row - c.sliding_window + 1).clamp(min=0, max=p)  # (q, 1) first visible key
        key = torch.arange(p + q_len, device=device)  # (p + q,)
        return ((key >= start) & (key <= p + row))[None, None]

    def _rope(self, position_ids: torch.Tensor, dtype: torch.dtype):
        c = self.config
        return rope_cos_sin(position_ids, c.head_dim, c.rope_theta, dtype, c.rope_scaling)

    def inv_freq(self, device=None) -> torch.Tensor:
        """The RoPE frequencies (head_dim / 2,) the head rotates by, its scaling included: what a spec's distance
        fix re-rotates queries and keys with (every RoPE this config reads can be re-rotated)."""
        c = self.config
        return rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling, device)[0]

    def encode_context(self, features: torch.Tensor, position_ids: torch.Tensor):
        """Per-layer context (key, value), each (B, kv_heads, n, D), post-norm and post-RoPE.

        ``features`` (B, n, len(ids) * target_hidden) from :func:`context_features`; ``position_ids``
        (B, n) their positions. A block at ``p`` uses the first ``p`` context positions.
        """
        ctx = self.hidden_norm(self.fc(features))  # (B, n, H)
        cos, sin = self._rope(position_ids, ctx.dtype)
        return [layer.self_attn.project_kv(ctx, cos, sin) for layer in self.layers]

    def forward_block(self, noise_embedding: torch.Tensor, position_ids: torch.Tensor, context,
                      masks=None, context_positions: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Normed output hidden states (B, q, H) of a block.

        ``noise_embedding`` (B, q, H): the target's embedding of anchor + mask tokens (times
        ``input_embedding_scale``); ``position_ids`` (B, q); ``context`` from :meth:`encode_context`
        cut to the block's prefix (``p`` positions). Each layer sees the keys of :meth:`visible_mask`:
        all ``p + q`` in full layers, a window in sliding ones; ``masks`` (one bool mask per layer,
        (1, 1, q, p + q), True where visible) replaces them, e.g. for many blocks in one call
        (:func:`anchored_masks`). ``context_positions`` (p,): the context keys' positions when they are
        not ``0 .. p - 1`` (columns cut by a window). The attention call is told every query's and key's
        position (``query_positions``, ``key_positions``), which a spec's distance fix reads; one sequence
        at a time (the positions of batch row 0).
        """
        cos, sin = self._rope(position_ids, noise_embedding.dtype)
        h = noise_embedding
        p, q_len = context[0][0].shape[2], noise_embedding.shape[1]
        if context_positions is None:
            context_positions = torch.arange(p, device=position_ids.device)
        kwargs.update(query_positions=position_ids[0], key_positions=torch.cat((context_positions, position_ids[0])))
        for i, (layer, ctx) in enumerate(zip(self.layers, context)):
            mask = self.visible_mask(i, p, q_len, h.device) if masks is None else masks[i]
            h = layer(h, ctx, cos, sin, mask, **kwargs)
        return self.norm(h)

    def forward(self, noise_embedding: torch.Tensor, target_hidden: torch.Tensor, position_ids: torch.Tensor,
                **kwargs) -> torch.Tensor:
        """DFlash's own call: context features (B, p, ·) and block (B, q, H); ``position_ids``
        (B, p + q) cover the context then the block. Returns the normed block hidden states."""
        p = target_hidden.shape[1]
        context = self.encode_context(target_hidden, position_ids[:, :p])
        return self.forward_block(noise_embedding, position_ids[:, p:], context, context_positions=position_ids[0, :p],
                                  **kwargs)

    def draft_ids(self) -> torch.Tensor | None:
        """Target ids of the draft vocabulary, ``i + d2t[i]`` (None: the whole vocabulary)."""
        d2t = getattr(self, "d2t", None)
        return None if d2t is None else torch.arange(len(d2t), device=d2t.device) + d2t

    def compute_logits(self, hidden: torch.Tensor, target: nn.Module) -> torch.Tensor:
        """Draft logits (..., vocab) of block rows ``hidden`` (..., H) from the target's output head; DFlash
        drafts from rows 1..q-1 of a block. With a draft vocabulary only its rows of the head run (a
        twelfth of the head for 4,096 of SmolLM2's 49,152 tokens) and every other column is ``-inf``: the
        drafts, and the laws speculative sampling draws them from, never leave it."""
        head = target.get_output_embeddings()
        if getattr(self, "d2t", None) is None:
            return head(hidden)
        logits = self.draft_logits(hidden, target)  # cuts the draft rows of the head, once
        out = hidden.new_full((*hidden.shape[:-1], head.weight.shape[0]), float("-inf"))
        out[..., self._draft_rows[1]] = logits.to(out.dtype)
        return out

    def draft_logits(self, hidden: torch.Tensor, target: nn.Module) -> torch.Tensor:
        """The logits over the draft vocabulary alone (..., draft), column ``i`` the token ``draft_ids()[i]``
        (over the whole vocabulary without one): :meth:`compute_logits`' finite columns, without the rest."""
        head = target.get_output_embeddings()
        d2t = getattr(self, "d2t", None)
        if d2t is None:
            return head(hidden)
        # the rows are cut once per head and map (buffers made in inference mode keep no version counter)
        key = (head.weight.data_ptr(), head.weight.dtype, head.weight.device, d2t.data_ptr())
        if self._draft_rows is None or self._draft_rows[0] != key:
            ids = self.draft_ids()
            bias = None if head.bias is None else head.bias.detach()[ids]
            self._draft_rows = (key, ids.to(head.weight.device), head.weight.detach()[ids], bias)
        _, _, weight, bias = self._draft_rows
        return nn.functional.linear(hidden.to(weight.dtype), weight, bias)


def context_features(target: nn.Module, input_ids: torch.Tensor, target_layer_ids) -> torch.Tensor:
    """cat(hidden_states[id + 1] for id in target_layer_ids): outputs of those target layers."""
    return hidden_state_features(target, input_ids, [i + 1 for i in target_layer_ids])


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------

def load_dflash(path: str | Path, target: nn.Module | None = None, *, device=None,
                dtype: torch.dtype | None = None) -> DFlashDraftModel:
    """Load a DFlash draft model from a directory with ``config.json`` and its weights.

    z-lab's key layout; the speculators layout adds ``embed_tokens.weight`` (used for the block
    embeddings, as speculators does) and ``lm_head.weight`` / ``d2t`` / ``t2d`` (not run).

    When ``target`` is given, its width, vocabulary and depth are checked against the config.
    """
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"DFlash checkpoint {path}: not a directory")
    config = DFlashConfig.from_json(path / "config.json")
    weights, file = read_weights(path, "DFlash")
    embed = weights.pop("embed_tokens.weight", None) if config.source == "speculators" else None
    if embed is not None and tuple(embed.shape) != (config.vocab_size, config.target_hidden_size):
        raise UserError(f"DFlash checkpoint {file}: weight 'embed_tokens.weight' has shape {tuple(embed.shape)}, "
                        f"expected {(config.vocab_size, config.target_hidden_size)} from config.json")
    if target is not None:
        tc = target.config
        layers = tc.num_hidden_layers
        # z-lab's id L - 1 reads transformers' hidden_states[L] as z-lab does; a speculators index L means
        # vLLM's capture before the final norm, which hidden_states[L] (after it) is not
        top = layers if config.source == "dflash" else layers - 1
        bad = [i for i in config.hidden_state_ids if not 0 <= i <= top]
        if bad or (config.num_target_layers is not None and config.num_target_layers != layers):
            name = "target_layer_ids" if config.source == "dflash" else "aux_hidden_state_layer_ids"
            raise UserError(f"DFlash checkpoint {path}: {name} {list(config.target_layer_ids)} "
                            f"(num_target_layers={config.num_target_layers}) do not fit a target with {layers} layers")
        if (tc.hidden_size, tc.vocab_size) != (config.target_hidden_size, config.vocab_size):
            raise UserError(f"DFlash checkpoint {path}: expects a target with hidden size {config.target_hidden_size} "
                            f"and vocabulary {config.vocab_size}, got {tc.hidden_size} and {tc.vocab_size}")
        if not 0 <= config.mask_token_id < tc.vocab_size:
            raise UserError(f"DFlash checkpoint {path}: mask_token_id {config.mask_token_id} is outside the "
                            f"target's vocabulary of {tc.vocab_size}")
    extra = _VARIANTS[config.variant][2] if config.variant in _VARIANTS else ()
    ignored = _IGNORED_WEIGHTS[config.source] + tuple(k for k in weights if k.startswith(extra))
    model = build(lambda: DFlashDraftModel(config), weights, file, "DFlash", device=device, dtype=dtype,
                  ignored=ignored)
    if embed is not None:
        model.embed_tokens = nn.Embedding.from_pretrained(embed.to(device=device, dtype=dtype or embed.dtype))
    ids = model.draft_ids()
    if ids is not None and (int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size or len(ids.unique()) < len(ids)):
        raise UserError(f"DFlash checkpoint {file}: 'd2t' maps the draft vocabulary to ids outside 0 .. "
                        f"{config.vocab_size - 1} or to one id twice; row i drafts target id i + d2t[i]")
    return model


# weights a layout may carry that do not reach the attention inputs: speculators' draft lm_head and its
# draft -> target vocabulary maps (logits only; calibration computes none)
_IGNORED_WEIGHTS = {"dflash": (), "speculators": ("lm_head.weight", "d2t", "t2d")}


# ----------------------------------------------------------------------------------------------
# Drafter adapter
# ----------------------------------------------------------------------------------------------

class DFlashAdapter:
    """Drafter adapter (``calibrate.drafters.base.Adapter``) for a DFlash model and its target.

    ``default_n_ref`` is the training length of a training record beside the checkpoint
    (``calibrate.drafters.checkpoint.training_length``: e.g. SpecForge's recipe ``data.max_length``), else
    :data:`DFLASH_DEFAULT_N_REF` (DFlash's config has no training length: ``max_position_embeddings`` is
    the target's, never trusted).
    """

    kind = "dflash"

    def __init__(self, model: DFlashDraftModel, target: nn.Module, tokenizer, path: str | None = None,
                 training: TrainingLength | None = None, pointer=None):
        c = model.config
        self.model, self.target, self.tokenizer = model, target, tokenizer
        self.pointer = pointer  # a copy pointer mixed into every block row (calibrate.drafters.pointer), or None
        self.info = DrafterInfo(kind="dflash", path=path, num_layers=c.num_hidden_layers,
                                num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                                head_dim=c.head_dim)
        if training is None or training.value is None:
            why = "no training record beside the checkpoint" if training is None else training.origin
            training = TrainingLength(DFLASH_DEFAULT_N_REF, f"{DFLASH_DEFAULT_N_REF}, SpecForge's DFlash recipe "
                                                            f"length ({why})")
        self.training = training
        self.default_n_ref = training.value
        self.device = model.fc.weight.device
        self.eos_token_id = None if tokenizer is None else eos_token_id(tokenizer)
        rope = "" if c.rope_scaling is None else f", {c.rope_scaling.rope_type} RoPE"
        ids = list(c.hidden_state_ids)
        self.notes = [f"DFlash model in {c.source}'s layout ({c.num_hidden_layers} layers, block {c.block_size}{rope}); "
                      + (f"reads target hidden_states {ids}: target_layer_ids {list(c.target_layer_ids)} read as "
                         f"id + 1 (the output of layer id), as DFlash does" if c.source == "dflash" else
                         f"reads target hidden_states {ids}: aux_hidden_state_layer_ids are hidden-state indices "
                         f"already (z-lab's ids + 1), read as is; block embeddings from the checkpoint's "
                         f"embed_tokens, its lm_head not run (calibration needs no logits)")]
        if c.variant in _VARIANTS:
            name, heads, prefixes, _ = _VARIANTS[c.variant]
            self.notes.append(f"{c.variant} loaded as DFlash: {name}'s attention is DFlash's, unchanged (same "
                              f"queries and keys); its {heads} ({', '.join(p + '*' for p in prefixes)}) only add to "
                              f"the logits, which calibration does not compute, and are not run")
        if c.sliding_window is not None:
            sliding = [i for i, t in enumerate(c.layer_types) if t == "sliding_attention"]
            self.notes.append(
                f"sliding-window layers {sliding} (W = {c.sliding_window}) use SpecForge's training mask: block row j "
                f"at p sees the context keys p + j - W + 1 .. p - 1 and the block keys p .. p + j, which the window "
                f"never cuts (z-lab's transformers path applies no window); each row's statistics use exactly the "
                f"keys it sees")

        if c.draft_vocab_size is not None:
            self.notes.append(f"drafts from {c.draft_vocab_size} of the target's {c.vocab_size} tokens (d2t): only "
                              f"their rows of the target's lm_head run")
        self.notes.append("training length: " + training.origin)
        if pointer is not None:
            from .pointer import describe

            self.notes.append(f"copy pointer ({describe(pointer)}): row j copies the token j places after a match")

    def tokenize(self, text: str) -> list[int]:
        """Target token ids of ``text``, without special tokens."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    predicts = 1  # teacher-forced row t: the block anchored at t, its row 1 guessing token t + 1
    parallel = True  # drafts a block in one forward: eval adds per-position metrics (calibrate.measure.blocks)

    @property
    def block_size(self) -> int:
        """Tokens in a block: the anchor and ``block_size - 1`` drafts per forward."""
        return self.model.config.block_size

    def teacher_forced(self, input_ids: torch.Tensor, runs, temperature: float = 1.0,
                       proposals: torch.Tensor | None = None):
        """Row ``t``: the block anchored at ``t`` guesses token ``t + 1`` (``calibrate.drafters.blocks``)."""
        from .blocks import block_teacher_forced

        self._check_draft_head()
        return block_teacher_forced(self.model, self.target, input_ids, self.model.config.hidden_state_ids, runs,
                                    temperature, proposals, self.pointer)

    @property
    def feature_ids(self) -> tuple[int, ...]:
        """The target ``hidden_states`` the model reads."""
        return tuple(self.model.config.hidden_state_ids)

    def proposer(self, spec):
        """Block drafting in the one speculative loop: ``block_size - 1`` drafts per forward
        (``calibrate.drafters.blocks.DFlashBlockProposer``), its copy pointer around it when it has one."""
        from .blocks import DFlashBlockProposer
        from .pointer import with_pointer

        self._check_draft_head()
        block = DFlashBlockProposer(self.model, self.target, spec)
        return block if self.pointer is None else with_pointer(block, self.pointer, spec)

    def _check_draft_head(self) -> None:
        """Drafting reads the target's ``lm_head`` (z-lab's layout); a speculators checkpoint drafts with its own
        ``lm_head`` over a draft vocabulary, which is not loaded: refused in one line."""
        if self.model.config.source == "speculators":
            raise UserError(f"DFlash checkpoint {self.info.path}: a speculators-layout DFlash drafts with its own "
                            "lm_head and draft vocabulary, which eval does not load; calibrate it, or convert it to "
                            "z-lab's layout")

    @torch.no_grad()
    def collect(self, input_ids: torch.Tensor, tap: AttentionTap, positions: torch.Tensor) -> None:
        """Place one block at each position ``p`` and call ``tap`` for every layer of every block.

        Context = target features of tokens ``[0, p)`` at positions ``0 .. p-1``; block = token ``p``
        then ``block_size - 1`` mask tokens at positions ``p .. p + block_size - 1``. Each call gets
        query (1, heads, block_size, D), key (1, kv_heads, p + block_size, D) and ``n_visible = p +
        block_size`` for every row (non-causal). Context keys are computed once and shared; blocks
        run one at a time, so keys are never padded. The tap is installed with
        ``calibrate.taps.attention_tap``, the function registered for every transformers drafter.

        In sliding layers a row's visible keys (:meth:`DFlashDraftModel.visible_mask`) end at its own
        position and need not start at key 0; the tap is then called once per group of rows with the
        same first visible key, with the keys from that one on (:func:`_visible_from_start`), so that
        every call keeps the tap's contract: each row sees the first ``n_visible`` keys it is given.
        Unlike the EAGLE-3 head, which runs only the rows inside its window, rows whose window is
        full (``n = W``) are kept.
        """
        c = self.model.config
        input_ids = input_ids.to(self.device)
        T = input_ids.shape[1]
        features = hidden_state_features(self.target, input_ids, c.hidden_state_ids)
        context = self.model.encode_context(features, torch.arange(T, device=self.device)[None])
        embed = self.model.embed_tokens if self.model.embed_tokens is not None else self.target.get_input_embeddings()
        dtype = self.model.fc.weight.dtype
        for p in positions.tolist():
            if not 0 <= p < T:
                raise ValueError(f"position {p} is outside the sequence of {T} tokens")
            block = torch.full((1, c.block_size), c.mask_token_id, dtype=torch.long, device=self.device)
            block[0, 0] = input_ids[0, p]
            noise = embed(block).to(dtype) * c.input_embedding_scale
            with attention_tap(self.model, _visible_from_start(tap, self.model, p)):
                self.model.forward_block(noise, torch.arange(p, p + c.block_size, device=self.device)[None],
                                         [(k[:, :, :p], v[:, :, :p]) for k, v in context])


def _visible_from_start(tap: AttentionTap, model: DFlashDraftModel, p: int) -> AttentionTap:
    """``tap`` for the block at ``p``, called so that each row's visible keys are the first it is given.

    A full layer's call goes to ``tap`` as it is. In a sliding layer row ``j`` sees the contiguous
    keys ``s_j .. s_j + n_j - 1`` of :meth:`DFlashDraftModel.visible_mask` (``n_j`` is the count the
    attention function passes); rows with the same start ``s`` go to ``tap`` together with
    ``key[:, :, s:]``. A query ``tap`` returns replaces those rows' queries.
    """
    def call(layer_idx, query, key, scaling, n_visible):
        mask = model.visible_mask(layer_idx, p, query.shape[2], query.device)
        if mask is None:
            return tap(layer_idx, query, key, scaling, n_visible)
        start = mask[0, 0].to(torch.int8).argmax(-1)  # (q,) first visible key of each row
        parts, replaced = [], False
        for s in start.unique_consecutive().tolist():
            rows = (start == s).nonzero()[:, 0]
            out = tap(layer_idx, query[:, :, rows], key[:, :, s:], scaling, n_visible[:, rows])
            replaced |= out is not None
            parts.append(query[:, :, rows] if out is None else out)
        return torch.cat(parts, dim=2) if replaced else None

    return call


def load(kind: str, drafter_path: str | None, target_path: str | None, device, dtype: torch.dtype) -> DFlashAdapter:
    """Load the DFlash model at ``drafter_path`` (None: the packaged head for SmolLM2, :data:`DFLASH_HEAD_DIR`)
    and its target (``calibrate.drafters.target.load_target``; None: SmolLM2)."""
    path = Path(drafter_path) if drafter_path is not None else DFLASH_HEAD_DIR
    if drafter_path is None and not (path / "config.json").is_file():
        raise UserError(f"the DFlash head for SmolLM2 is missing ({path}); train one with scripts/train_dflash.py "
                        "or pass --drafter-path DIR")
    if not path.is_dir():
        raise UserError(f"DFlash checkpoint {path}: not a directory")
    from .pointer import locate

    pointer, weights = locate(path)  # a copy pointer, here or joining the model it names
    target, tokenizer = load_target(target_path, device, dtype)
    model = load_dflash(weights, target, device=device, dtype=dtype)
    training = training_length(weights, model.config.max_position_embeddings, trust_mpe=False)
    return DFlashAdapter(model, target, tokenizer, None if drafter_path is None else str(drafter_path), training,
                         pointer)
