"""Visible keys: how many keys each query row of an attention call really attends to.

SharpDraft scales a query by ``alpha(n)``, ``n`` the number of keys the query sees (``docs/theory.md``),
so ``n`` must be the count of keys whose softmax weight the attention kernel leaves non-zero, not a
guess from the shapes. :func:`visible_keys` is that count for one call of a transformers attention
function ``fn(module, query, key, value, attention_mask, ..., is_causal=...)``; the runtime binding
(:mod:`sharpdraft_runtime.hf`), calibrate's attention taps and its drafter adapters all call it.
What the kernels compute, case by case:

* **a 4D mask** (padding, cached prefill, draft blocks, sliding windows, per-head masks): the keys
  it allows, counted per row by :func:`mask_n_visible`. Boolean masks allow ``True``; additive
  float masks allow every key whose bias is above the dtype's minimum (transformers writes
  ``finfo.min`` for masked keys; ``-inf`` is masked too). A query that sees nothing (a padding
  query) gets ``n = 0``.
* **no mask, sdpa, causal and q_len > 1**: transformers' ``sdpa_attention_forward`` passes
  ``is_causal=True`` to :func:`torch.nn.functional.scaled_dot_product_attention`, whose causal
  mask is *upper-left* aligned (query ``i`` sees keys ``0 .. i``), and crops the keys to
  ``q_len`` first. transformers omits the mask only where that is right: a prefill whose keys
  start at position 0 (``k_len == q_len``, or a static cache whose slots past ``q_len`` are
  empty). So ``n_i = min(i + 1, k_len)``. A prefill after cached keys, which needs the
  bottom-right alignment ``n_i = k_len - q_len + i + 1``, always comes with a mask, and so does
  a sliding window that leaves keys out.
* **no mask otherwise**: every key, ``n = k_len``. That is a single query (sdpa turns
  ``is_causal`` off for it: decoding), a non-causal call (DFlash blocks, ``module.is_causal =
  False``), and eager attention, which adds a mask when there is one and otherwise none.

:func:`causal_n_visible` gives the same counts from positions (cache length, padding, window, sinks)
for attention code that builds its own mask (:func:`causal_mask`), such as calibrate's EAGLE-3 head.

A spec's ``window`` and ``sinks`` (the attention restrictions serving engines use for long contexts)
are one rule, :func:`window_overlay`, and-ed into the mask the attention call receives; the count
is then the count of that mask, so ``n`` is the number of keys a query really sees.
"""

from __future__ import annotations

import torch

__all__ = ["visible_keys", "causal_n_visible", "mask_n_visible", "window_overlay", "causal_mask", "first_key",
           "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("sdpa", "eager")  # attention functions whose no-mask semantics visible_keys knows
_GROUP = 128  # mask entries summed in uint8 before widening (must stay <= 255)


def visible_keys(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 is_causal: bool | None = None, module: torch.nn.Module | None = None,
                 implementation: str = "sdpa") -> int | torch.Tensor:
    """Keys each query row of one attention call attends to (module docstring: the cases).

    Parameters
    ----------
    query : Tensor of shape (batch, heads, q_len, head_dim)
        The call's queries (only the shape and device are read).
    key : Tensor of shape (batch, kv_heads, k_len, head_dim)
        The call's keys, cache included.
    attention_mask : Tensor of shape (batch or 1, 1 or heads, q_len, >= k_len), optional
        The mask the attention function receives: boolean (True: visible) or additive float.
    is_causal : bool, optional
        The call's ``is_causal`` keyword; when None, ``module.is_causal`` and else True, as
        transformers' attention functions read it.
    module : torch.nn.Module, optional
        The attention layer, for its ``is_causal`` attribute.
    implementation : {"sdpa", "eager"}
        The attention function that runs: it decides what a call without a mask attends to.

    Returns
    -------
    int
        When every row sees all ``k_len`` keys and there is no mask to read.
    Tensor of shape (batch or 1, 1 or heads, q_len)
        Otherwise; int32 from a mask, int64 for sdpa's causal path.

    Examples
    --------
    >>> q, k = torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 5, 8)
    >>> visible_keys(q, k[:, :, :3]).tolist()  # causal prefill without a mask
    [[[1, 2, 3]]]
    >>> visible_keys(q, k, is_causal=False)  # a non-causal block over 5 keys
    5
    >>> mask = torch.tril(torch.ones(3, 5, dtype=torch.bool), diagonal=2)  # 2 cached keys
    >>> visible_keys(q, k, mask[None, None]).tolist()
    [[[3, 4, 5]]]
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {', '.join(IMPLEMENTATIONS)}, got {implementation!r}")
    q_len, k_len = query.shape[-2], key.shape[-2]
    if attention_mask is not None:
        if attention_mask.ndim != 4:
            raise ValueError(f"expected a 4D attention mask (batch, 1 or heads, q_len, k_len), "
                             f"got shape {tuple(attention_mask.shape)}")
        return mask_n_visible(attention_mask, k_len)
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if implementation == "sdpa" and is_causal and q_len > 1:
        n = causal_n_visible(q_len, device=query.device)  # (1, q_len): upper-left, from key 0
        return n.clamp_(max=k_len)[:, None]  # (1, 1, q_len)
    return k_len


def causal_n_visible(q_len: int, past: int = 0, *, key_mask: torch.Tensor | None = None,
                     sliding_window: int | None = None, sinks: int | None = None,
                     device: torch.device | str | None = None) -> torch.Tensor:
    """Visible keys of causal queries: ``n_i = past + i + 1``, less padding and keys outside the window.

    Parameters
    ----------
    q_len : int
        Queries in this forward (1 when decoding, the block length for a draft block).
    past : int
        Keys already in the cache before these queries.
    key_mask : Tensor of shape (batch, past + q_len), optional
        1/True for real keys, 0/False for padding (the tokenizer's ``attention_mask``); any
        padding pattern, left padding included.
    sliding_window : int, optional
        A query at position ``p`` sees keys ``p - sliding_window < j <= p`` (transformers' convention;
        the spec's ``window``).
    sinks : int, optional
        Besides the window, keys at the first ``sinks`` positions from the first real key stay
        visible (StreamingLLM; the spec's ``sinks``; needs ``sliding_window``). The rule is
        :func:`window_overlay`'s.
    device : torch.device or str, optional
        Device of the result (default: that of ``key_mask``, else CPU).

    Returns
    -------
    Tensor of shape (batch or 1, q_len), int64

    Notes
    -----
    With ``seen[j]`` the real keys at positions ``<= j``, ``cut = p - W`` the last position left
    of the window and ``f`` the first real position::

        n_p = seen[p] - seen[cut] + seen[min(f + S - 1, cut)]      (seen[< 0] = 0)

    Without padding and with both, ``n_p = min(p + 1, W + S)``.

    Examples
    --------
    >>> causal_n_visible(3, past=2).tolist()
    [[3, 4, 5]]
    >>> causal_n_visible(2, past=1, key_mask=torch.tensor([[0, 1, 1]]), sliding_window=2).tolist()
    [[1, 2]]
    >>> causal_n_visible(4, past=4, sliding_window=3, sinks=2).tolist()
    [[5, 5, 5, 5]]
    """
    if sinks is not None and sliding_window is None:
        raise ValueError("sinks are kept besides a sliding window: give sliding_window too")
    device = key_mask.device if key_mask is not None and device is None else device
    pos = torch.arange(past, past + q_len, device=device)  # (q_len,) absolute positions
    if key_mask is None:
        key_mask = torch.ones(1, past + q_len, dtype=torch.bool, device=device)
    seen = key_mask.to(torch.int64).cumsum(-1)  # (B, past + q_len): real keys at positions <= j
    n = seen[:, pos]  # (B, q_len)
    if sliding_window is not None:
        cut = pos - sliding_window  # (q_len,) keys at positions <= cut are outside the window
        n = n - torch.where(cut >= 0, seen[:, cut.clamp(min=0)], 0)
        if sinks is not None:
            first = (seen == 0).sum(-1, keepdim=True)  # (B, 1) position of the first real key
            last_sink = torch.minimum(first + sinks - 1, cut)  # (B, q_len) last sink position left of the window
            n = n + torch.where(last_sink >= 0, seen.gather(1, last_sink.clamp(min=0)), 0)
    return n


def window_overlay(window: int, sinks: int | None = None, first: torch.Tensor | None = None):
    """The keys a window (and sinks) keep, as a ``mask_mod(batch_idx, head_idx, q_idx, kv_idx) -> bool``.

    Key ``kv`` stays visible to the query at position ``q`` when ``kv > q - window`` (its last
    ``window`` positions, the query's own included) or ``kv < first + sinks`` (the first ``sinks``
    positions from the sequence's first real key). Causality and padding are separate masks,
    combined with this one by "and". The signature is transformers' ``mask_function`` and
    FlexAttention's ``mask_mod``; indices may be broadcasting tensors.

    Parameters
    ----------
    window : int
        W, the spec's ``window``.
    sinks : int, optional
        S, the spec's ``sinks``.
    first : Tensor of shape (batch,), optional
        Position of each sequence's first real key (left padding); default 0.

    Examples
    --------
    >>> q, kv = torch.arange(5)[:, None], torch.arange(5)[None]
    >>> (window_overlay(2, sinks=1)(0, 0, q, kv) & (kv <= q)).int().tolist()
    [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [1, 0, 0, 1, 1]]
    """

    def overlay(batch_idx, head_idx, q_idx, kv_idx):
        keep = kv_idx > q_idx - window
        if sinks is not None:
            keep = keep | (kv_idx < (0 if first is None else first[batch_idx]) + sinks)
        return keep

    return overlay


def causal_mask(q_len: int, past: int = 0, *, sliding_window: int | None = None, sinks: int | None = None,
                positions: torch.Tensor | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean mask (q_len, past + q_len) of causal queries after ``past`` cached keys, window and sinks applied.

    For attention code that builds its own mask (calibrate's EAGLE-3 head); row ``i`` has
    ``causal_n_visible(q_len, past, sliding_window=..., sinks=...)[0, i]`` True entries.
    ``positions`` (shape (rows,)) builds only the rows of the queries at those positions instead.
    """
    q = torch.arange(past, past + q_len, device=device) if positions is None else positions  # query positions
    kv = torch.arange(past + q_len, device=device)[None]  # (1, k_len) key positions
    visible = kv <= q[:, None]  # (rows, k_len)
    if sliding_window is not None:
        visible &= window_overlay(sliding_window, sinks)(0, 0, q[:, None], kv)
    return visible


def first_key(padding_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Position of the first real key per row of a 2D padding mask (batch, k_len); None for None."""
    return None if padding_mask is None else (padding_mask.to(torch.int64).cumsum(-1) == 0).sum(-1)


def mask_n_visible(attention_mask: torch.Tensor, k_len: int | None = None) -> torch.Tensor:
    """Visible keys per query row of a 4D attention mask (causal, cache, padding, window, blocks alike).

    Parameters
    ----------
    attention_mask : Tensor of shape (batch, 1 or heads, q_len, >= k_len)
        Boolean (True: the key is visible) or additive float (visible where the bias is above the
        dtype's minimum, the value transformers uses for masked keys; ``-inf`` is masked too).
    k_len : int, optional
        Keys actually attended; a longer mask is cut to its first ``k_len`` columns.

    Returns
    -------
    Tensor of shape (batch, 1 or heads, q_len), int32

    Notes
    -----
    torch sums a boolean tensor by first casting all of it to int64 (8 bytes per mask entry). We
    instead sum groups of 128 entries in uint8 (a group sums to at most 128, so no overflow),
    then the group sums in int32: the temporaries are 1/128 and 1/32 of the mask's bytes, far
    below the float copy of the mask that SDPA itself makes.
    """
    mask = attention_mask if k_len is None else attention_mask[..., :k_len]
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min
    mask = mask.view(torch.uint8)
    k = mask.shape[-1]
    whole = k - k % _GROUP
    n = mask[..., :whole].unflatten(-1, (whole // _GROUP, _GROUP)).sum(-1, dtype=torch.uint8).sum(-1, dtype=torch.int32)
    if whole < k:
        n += mask[..., whole:].sum(-1, dtype=torch.int32)
    return n
