"""Drafter adapters, one small module per kind, loaded lazily by ``load_drafter``.

==========  ===============================  ==============================================
kind        module                           what runs
==========  ===============================  ==============================================
``hf``      ``calibrate.drafters.hf``        any ``AutoModelForCausalLM`` (default: SmolLM2)
``pard``    ``calibrate.drafters.hf``        a PARD drafter: a causal LM, same as ``hf``
``eagle3``  ``calibrate.drafters.eagle3``    target features, then the EAGLE-3 head
``dflash``  ``calibrate.drafters.dflash``    target features, then DFlash blocks
==========  ===============================  ==============================================

Each adapter satisfies ``calibrate.drafters.base.Drafter``.
"""

from __future__ import annotations

import importlib

import torch

from ..errors import UserError

__all__ = ["KINDS", "load_drafter", "resolve_device", "resolve_dtype"]

KINDS = ("hf", "pard", "eagle3", "dflash")
_CLASSES = {"eagle3": "Eagle3Drafter", "dflash": "DFlashDrafter"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """``auto`` is CUDA when present, else CPU; ``cuda`` without a GPU is a ``UserError``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: no CUDA GPU is visible to torch; use --device cpu")
    try:
        return torch.device(device)
    except RuntimeError:
        raise UserError(f"--device {device}: expected auto, cpu or cuda[:N]") from None


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """Weight dtype: ``auto`` is bfloat16 on CUDA and float32 on CPU (statistics are always fp32)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise UserError(f"--dtype {dtype}: expected auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def load_drafter(kind: str, drafter_path: str | None, target_path: str | None, device: torch.device,
                 dtype: torch.dtype):
    """Load a drafter of ``kind`` (see the table above); ``None`` paths mean the built-in defaults."""
    if kind not in KINDS:
        raise UserError(f"--drafter {kind}: expected one of {', '.join(KINDS)}")
    if kind in ("hf", "pard"):
        from . import hf

        return hf.load(kind, drafter_path, target_path, device, dtype)
    try:
        module = importlib.import_module(f"{__name__}.{kind}")
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{kind}":
            raise
        raise UserError(f"--drafter {kind}: this sharpdraft build has no {kind} adapter") from None
    return getattr(module, _CLASSES[kind]).load(drafter_path, target_path, device, dtype)
