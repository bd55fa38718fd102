"""Drafter checkpoints on disk: ``config.json`` fields and weights, with one-line errors for bad ones.

A checkpoint folder holds ``config.json`` and ``model.safetensors`` (or ``pytorch_model.bin``).
Loading one is: :func:`read_config`, then typed fields with :func:`config_field`; then
:func:`read_weights`, key spellings mapped to the module's own with :func:`rename_prefixes` (other
layouts of the same model, e.g. vLLM's), and :func:`build` to make the module on the meta device
and fill it, every key and shape checked (:func:`check_and_fill`). Each problem is a ``UserError``
that names the file, the key or field, and what was expected.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..errors import UserError

__all__ = ["read_config", "config_field", "read_weights", "rename_prefixes", "check_and_fill", "build"]


def read_config(path: str | Path, what: str) -> dict:
    """The parsed ``config.json`` at ``path``; a missing or malformed file is a one-line UserError."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{what} checkpoint: {path} not found") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None


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


def read_weights(path: Path, kind: str) -> tuple[dict[str, torch.Tensor], Path]:
    """State dict of ``model.safetensors`` or ``pytorch_model.bin`` in ``path``, and the file read."""
    st, pt = path / "model.safetensors", path / "pytorch_model.bin"
    if st.is_file():
        from safetensors.torch import load_file
        return load_file(str(st)), st
    if pt.is_file():
        return torch.load(pt, map_location="cpu", weights_only=True), pt
    raise UserError(f"{kind} checkpoint {path}: neither model.safetensors nor pytorch_model.bin found")


def rename_prefixes(weights: dict[str, torch.Tensor], prefixes: dict[str, str]) -> dict[str, torch.Tensor]:
    """``weights`` with each key starting with a key of ``prefixes`` given that prefix's value instead."""
    renamed = {}
    for key, value in weights.items():
        old = next((p for p in prefixes if key.startswith(p)), None)
        renamed[key if old is None else prefixes[old] + key[len(old):]] = value
    return renamed


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


def build(make: Callable[[], nn.Module], weights: dict[str, torch.Tensor], file: Path, kind: str, *,
          optional: dict[str, torch.Tensor] | None = None, device=None, dtype: torch.dtype | None = None) -> nn.Module:
    """``make()`` on the meta device, filled with ``weights`` (:func:`check_and_fill`), moved to
    ``device`` / ``dtype``, in eval mode."""
    with torch.device("meta"):
        module = make()
    module.load_state_dict(check_and_fill(module, weights, file, kind, optional), assign=True)
    return module.to(device=device, dtype=dtype).eval()
