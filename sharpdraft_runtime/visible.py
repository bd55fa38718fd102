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

:func:`causal_n_visible` gives the same counts from positions (cache length, padding, window) for
attention code that builds its own mask, such as calibrate's EAGLE-3 head.
"""

from __future__ import annotations

import torch

__all__ = ["visible_keys", "causal_n_visible", "mask_n_visible", "IMPLEMENTATIONS"]

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
                     sliding_window: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
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
        A query at position ``p`` sees keys ``p - sliding_window < j <= p`` (transformers' convention).
    device : torch.device or str, optional
        Device of the result (default: that of ``key_mask``, else CPU).

    Returns
    -------
    Tensor of shape (batch or 1, q_len), int64

    Examples
    --------
    >>> causal_n_visible(3, past=2).tolist()
    [[3, 4, 5]]
    >>> causal_n_visible(2, past=1, key_mask=torch.tensor([[0, 1, 1]]), sliding_window=2).tolist()
    [[1, 2]]
    """
    device = key_mask.device if key_mask is not None and device is None else device
    pos = torch.arange(past, past + q_len, device=device)  # (q_len,) absolute positions
    if key_mask is None:
        n = pos + 1
        return (n.clamp(max=sliding_window) if sliding_window is not None else n)[None]
    seen = key_mask.to(torch.int64).cumsum(-1)  # (B, past + q_len): real keys at positions <= j
    n = seen[:, pos]
    if sliding_window is not None:
        cut = pos - sliding_window  # keys at positions <= cut are outside the window
        n = n - torch.where(cut >= 0, seen[:, cut.clamp(min=0)], 0)
    return n


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
