"""What every drafter adapter provides, and the attention tap it calls.

An adapter loads one kind of drafter (and its target, for feature-based drafters), runs it over
a token sequence, and hands each attention layer's post-RoPE queries and keys to a tap. The tap
decides which query rows to keep and reduces them to statistics at once (``calibrate.collect``),
so no adapter ever holds an n x n attention matrix.
"""

from __future__ import annotations

from typing import Protocol

import torch

from sharpdraft_theory.spec import DrafterInfo

__all__ = ["AttentionTap", "Drafter"]


class AttentionTap(Protocol):
    def __call__(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, scaling: float,
                 n_visible: torch.Tensor) -> None:
        """Receive one attention call.

        Parameters
        ----------
        layer_idx : int
            Attention layer index in the drafter (0 for a one-layer EAGLE-3 head).
        query : Tensor, shape (batch, heads, q_len, head_dim)
            Post-RoPE queries (before any query scaling).
        key : Tensor, shape (batch, kv_heads, k_len, head_dim)
            Post-RoPE keys, including cached context; ``heads % kv_heads == 0`` (GQA).
        scaling : float
            Softmax scale (``head_dim ** -0.5`` unless the model says otherwise).
        n_visible : LongTensor, shape (batch, q_len)
            Keys each query may attend to; the visible keys of query ``i`` are the first
            ``n_visible[b, i]`` positions of ``key`` for causal attention, or all of them for
            non-causal blocks (then ``n_visible == k_len``).
        """


class Drafter(Protocol):
    kind: str  # hf, pard, eagle3 or dflash
    info: DrafterInfo  # identity and attention shape, recorded in the spec
    default_n_ref: int  # the drafter's training context length (from its config or a documented preset)
    device: torch.device

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` in the drafter's (or its target's) vocabulary."""

    def collect(self, input_ids: torch.Tensor, tap: AttentionTap, positions: torch.Tensor) -> None:
        """Run the drafter over ``input_ids`` (shape (1, T)) and call ``tap`` for every attention layer.

        ``positions`` (LongTensor, sorted, values in [0, T)) are the query positions calibration
        wants; causal drafters may run the whole prefill and let the tap select rows, block
        drafters (DFlash) place one block at each position.
        """
