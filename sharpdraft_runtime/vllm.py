"""A vLLM plugin that applies a scale spec to the EAGLE-3 drafter's attention (vLLM's CPU build).

Registered as the ``vllm.general_plugins`` entry point ``sharpdraft`` (pyproject.toml), which vLLM loads
in every process before it builds a model. With ``SHARPDRAFT_SPEC`` unset or empty, :func:`register`
returns at once and changes nothing. With a spec path it

1. reads the spec through the validator (``ScaleSpec.load``) and refuses what vLLM cannot serve
   (:func:`sharpdraft_runtime.serving.load_spec`);
2. checks the engine once its configuration is made (``EngineArgs.create_engine_config``, in the
   process that starts the engine): CPU platform, speculative method eagle3, the drafter's shape, its
   maximum length at least the serving length (:func:`sharpdraft_runtime.serving.check_engine`);
3. replaces the implementation of the CPU attention backend (``CPU_ATTN``, through vLLM's backend
   registry) by :class:`SharpDraftCPUAttentionImpl`, which acts on the drafter's layers only.

A refusal stops the engine in one line (``SystemExit``: the message, exit 1, no traceback).

Per call of a drafter layer, each query row is multiplied in place by ``alpha(n)`` for the ``n`` keys it
sees (``seq_len - q_len + j + 1`` from the call's metadata, at most the window), then vLLM's own kernel
runs with its own scale; a spec's window becomes that layer's sliding window (vLLM's kernel keeps the
last ``W`` keys). A target layer is routed to the stock kernel on its first call and never comes back
here. ``SHARPDRAFT_TRACE=FILE`` appends each layer's routing and every scaled call's counts and factors
to FILE as JSON lines (for tests; it costs a file write per call).
"""

from __future__ import annotations

import functools
import os

from sharpdraft_theory import SpecError
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from .serving import TRACE_ENV, TokenScaler, check_engine, drafter_layer, load_spec, spec_path, trace

__all__ = ["register", "SharpDraftCPUAttentionBackend", "SharpDraftCPUAttentionImpl"]

_SPEC = None  # the spec this process applies, set by register()


def _refuse(message: str) -> None:
    raise SystemExit(f"sharpdraft: {message}")


def register() -> None:
    """The entry point: nothing without ``SHARPDRAFT_SPEC``; else load the spec, check the engine, wrap the backend."""
    global _SPEC
    path = spec_path()
    if path is None:
        return
    try:
        _SPEC = load_spec(path)
    except SpecError as err:
        _refuse(str(err))
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.{SharpDraftCPUAttentionBackend.__qualname__}")
    if not getattr(EngineArgs.create_engine_config, "_sharpdraft", False):
        EngineArgs.create_engine_config = _checked(EngineArgs.create_engine_config)


def _checked(create):
    """``EngineArgs.create_engine_config`` followed by :func:`_check_engine` on what it made."""
    @functools.wraps(create)
    def create_engine_config(self, *args, **kwargs):
        config = create(self, *args, **kwargs)
        _check_engine(config)
        return config

    create_engine_config._sharpdraft = True
    return create_engine_config


def _check_engine(config) -> None:
    from vllm.platforms import current_platform

    spec_config = config.speculative_config
    draft = None if spec_config is None else spec_config.draft_model_config
    try:
        check_engine(_SPEC, cpu=current_platform.is_cpu(), method=None if spec_config is None else spec_config.method,
                     draft_layers=0 if draft is None else draft.hf_text_config.num_hidden_layers,
                     draft_heads=0 if draft is None else draft.hf_text_config.num_attention_heads,
                     draft_length=0 if draft is None else draft.max_model_len,
                     serving_length=config.model_config.max_model_len,
                     draft_path=None if draft is None else draft.model)
    except SpecError as err:
        _refuse(str(err))


class SharpDraftCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, with the drafter's queries scaled by ``alpha(n)`` (module docstring)."""

    def __init__(self, *args, **kwargs):
        from vllm.config import get_current_vllm_config

        super().__init__(*args, **kwargs)
        config = get_current_vllm_config()
        spec_config = config.speculative_config
        self._target_layers = config.model_config.get_total_num_hidden_layers()
        self._draft_layers = 0 if spec_config is None else spec_config.draft_model_config.get_total_num_hidden_layers()
        self._trace = os.environ.get(TRACE_ENV) or None
        self._scaler = None if _SPEC is None else TokenScaler(_SPEC)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        """First call: route the layer (module docstring); a target layer never reaches this method again."""
        index = None if self._scaler is None else drafter_layer(layer.layer_name, self._target_layers,
                                                                self._draft_layers)
        if index is None:
            self.forward = functools.partial(CPUAttentionBackendImpl.forward, self)
        else:
            self._layer = index
            if self._scaler.window is not None:
                self.sliding_window = self._scaler.window
            self.forward = self._drafter_forward
        if self._trace:
            trace(self._trace, {"layer": layer.layer_name, "drafter_layer": index, "scale": self.scale,
                                "sliding_window": self.sliding_window})
        return self.forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)

    def _drafter_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        if attn_metadata is not None:
            scaled = self._scaler.scale_(query, attn_metadata.query_start_loc, attn_metadata.seq_lens,
                                         attn_metadata.num_actual_tokens, self._layer)
            if self._trace and scaled is not None:
                n, alpha = scaled
                trace(self._trace, {"layer": layer.layer_name, "query_start_loc": attn_metadata.query_start_loc.tolist(),
                                    "seq_lens": attn_metadata.seq_lens.tolist(), "n": n.tolist(),
                                    "alpha": alpha[:, :, 0].tolist()})
        return CPUAttentionBackendImpl.forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                                               *args, **kwargs)


class SharpDraftCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with :class:`SharpDraftCPUAttentionImpl` as its implementation."""

    @staticmethod
    def get_impl_cls() -> type[SharpDraftCPUAttentionImpl]:
        return SharpDraftCPUAttentionImpl
