"""Drafter adapters: the registry of kinds, one small module per kind, loaded lazily.

``KINDS`` is the one list of drafter kinds: the CLI's help and validation, ``load_drafter`` and
``sharpdraft eval`` all read it. Adding a kind is one adapter module under this package, whose
``load(kind, drafter_path, target_path, device, dtype)`` returns an object satisfying
``calibrate.drafters.base.Adapter``, and one line in ``KINDS``.

Shared pieces live beside the adapters: ``layers`` (RMSNorm, RoPE, attention), ``checkpoint``
(config.json fields, weights with shape checks) and ``target`` (loading causal LMs and their
tokenizers, reading a target's hidden states).

This module imports no torch at import time, so the CLI can build its help from ``KINDS`` quickly.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

__all__ = ["ASSETS", "DEFAULT_DRAFTERS", "DrafterKind", "KINDS", "AUX_READINGS", "aux_offset", "default_drafter_path",
           "drafter_kind", "drafts_in_parallel", "kind_names", "load_drafter", "resolve_device", "resolve_dtype"]


@dataclass(frozen=True)
class DrafterKind:
    """One drafter kind: where its adapter lives and what it supports."""

    module: str  # adapter module in this package; it defines load(kind, drafter_path, target_path, device, dtype)
    runs: str  # what runs, in a few words (CLI help and docs)
    evaluates: bool  # has teacher_forced and proposer, so sharpdraft eval supports it
    reads_aux_layers: bool = False  # its load takes aux_layer_reading (--aux-layer-reading)
    causal_lm: bool = False  # a whole causal LM, with no target of its own: --select needs --target-path
    parallel: bool = False  # drafts several tokens from one forward: eval adds per-position metrics (measure.blocks)
    blocks: bool = False  # drafts a block of its checkpoint's block size (the adapter's block_size) per forward
    online: bool = False  # teacher-forced online adaptation (calibrate.online, sharpdraft eval) can adapt its head
    online_decoding: bool = False  # online adaptation in the decoding loop (calibrate.online.OnlineProposer, bench)
    pointer: bool = False  # a copy pointer (calibrate.drafters.pointer) can join it: the adapter's pointer
    default: str | None = None  # the folder under calibrate/assets that --drafter-path's absence names (None: the
    # adapter's own built-in); the built-in drafters start users on the head with its copy pointer


KINDS: dict[str, DrafterKind] = {
    "hf": DrafterKind("hf", "any causal LM (default: the embedded SmolLM2)", evaluates=True, causal_lm=True),
    "pard": DrafterKind("hf", "a PARD drafter: K drafts from one forward over its mask tokens (default: the SmolLM2 "
                        "one with its copy pointer)", evaluates=True, causal_lm=True, parallel=True, online_decoding=True,
                        pointer=True, default="pard-smollm2-copy"),
    "eagle3": DrafterKind("eagle3", "target features, then the EAGLE-3 head (default: the SmolLM2 demo head with its "
                          "copy pointer)", evaluates=True, reads_aux_layers=True, online=True, online_decoding=True,
                          pointer=True, default="eagle3-smollm2-copy"),
    "dflash": DrafterKind("dflash", "target features, then DFlash blocks (B - 1 drafts per forward; default: the "
                          "SmolLM2 head with its copy pointer)", evaluates=True, parallel=True, blocks=True,
                          online_decoding=True, pointer=True, default="dflash-smollm2-copy"),
}
ASSETS = Path(__file__).resolve().parent.parent / "assets"  # the built-in drafters' folders
# what --drafter-path's absence means, for the commands' help
DEFAULT_DRAFTERS = ("for eagle3, dflash and pard the SmolLM2 head with its copy pointer, "
                    "calibrate/assets/KIND-smollm2-copy; the head alone is calibrate/assets/KIND-smollm2")
_DTYPES = ("float32", "bfloat16", "float16")
# How engines read the auxiliary layer ids k written in a drafter's config.json: hidden_states[k + aux_offset(...)].
# vLLM: k as is. SGLang (through which SpecForge trains) since its PR #25454: k + 1 only when the first id is 1
# (ids naming layer outputs; a first id of 2 names layer inputs, read as is); before it, k + 1 always.
# docs/drafters.md has the sources.
AUX_READINGS = {
    "vllm": "id as is",
    "sglang": "id + 1 when the first id is 1, else id as is (SGLang since PR #25454)",
    "sglang-legacy": "id + 1 always (SGLang before PR #25454)",
}


def aux_offset(reading: str, ids) -> int:
    """What ``reading`` (a key of ``AUX_READINGS``) adds to each of the aux layer ``ids`` to get a
    ``hidden_states`` index."""
    if reading == "vllm":
        return 0
    if reading == "sglang":
        return int(ids[0] == 1)
    if reading == "sglang-legacy":
        return 1
    raise UserError(f"--aux-layer-reading {reading}: expected one of {', '.join(AUX_READINGS)}")


def kind_names(*, evaluates: bool = False) -> list[str]:
    """Names of the kinds (only those ``sharpdraft eval`` supports with ``evaluates``), in registry order."""
    return [name for name, kind in KINDS.items() if kind.evaluates or not evaluates]


def drafter_kind(name: str, *, evaluates: bool = False) -> DrafterKind:
    """The registry entry of ``--drafter name``; a ``UserError`` for an unknown kind, and with
    ``evaluates`` for a kind that ``sharpdraft eval`` does not support."""
    if name not in KINDS:
        raise UserError(f"--drafter {name}: expected one of {', '.join(KINDS)}")
    if evaluates and not KINDS[name].evaluates:
        raise UserError(f"--drafter {name}: eval supports {', '.join(kind_names(evaluates=True))}")
    return KINDS[name]


def default_drafter_path(kind: str, drafter_path: str | None) -> str | None:
    """``--drafter-path`` as given, or where it is absent the built-in drafter of ``kind`` (``DrafterKind.default``:
    the SmolLM2 head with its copy pointer); None where the kind's adapter picks its own default (``hf``).
    The heads alone stay loadable by name: ``calibrate/assets/eagle3-smollm2`` and its kin."""
    if drafter_path is not None:
        return drafter_path
    default = drafter_kind(kind).default
    return None if default is None else str(ASSETS / default)


def drafts_in_parallel(drafter) -> bool:
    """Whether the loaded ``drafter`` drafts several tokens from one forward: its kind can
    (``DrafterKind.parallel``) and its checkpoint does (a PARD checkpoint without its mask token
    cannot: the adapter's ``parallel``)."""
    return KINDS[drafter.kind].parallel and drafter.parallel


def load_drafter(kind: str, drafter_path: str | None, target_path: str | None, device, dtype, *,
                 aux_layer_reading: str | None = None, pointer_unmatched: str | None = None):
    """Load a drafter of ``kind`` on ``device`` in ``dtype``; a ``None`` path means the built-in default
    (:func:`default_drafter_path`: for EAGLE-3, DFlash and PARD the SmolLM2 head with its copy pointer).

    ``aux_layer_reading`` (``--aux-layer-reading``; None: the checkpoint's own framework decides)
    says which engine's reading of auxiliary layer ids applies, for kinds that read target layers.
    ``pointer_unmatched`` (``--pointer-unmatched``, checked by ``calibrate.drafters.pointer.check_unmatched``;
    None: as the file says) sets how the copy pointer counts rows that match nothing.
    """
    entry = drafter_kind(kind)
    drafter_path = default_drafter_path(kind, drafter_path)
    module = importlib.import_module(f"{__name__}.{entry.module}")
    if aux_layer_reading is None:
        drafter = module.load(kind, drafter_path, target_path, device, dtype)
    elif aux_layer_reading not in AUX_READINGS:
        raise UserError(f"--aux-layer-reading {aux_layer_reading}: expected one of {', '.join(AUX_READINGS)}")
    elif not entry.reads_aux_layers:
        names = [name for name, k in KINDS.items() if k.reads_aux_layers]
        raise UserError(f"--aux-layer-reading applies to --drafter {', '.join(names)} only, not {kind}")
    else:
        drafter = module.load(kind, drafter_path, target_path, device, dtype, aux_layer_reading=aux_layer_reading)
    if pointer_unmatched is not None:
        from .pointer import set_unmatched

        set_unmatched(drafter, pointer_unmatched)
    return drafter


def resolve_device(device: str):
    """``auto`` is CUDA when present, else CPU; ``cuda`` without a GPU is a ``UserError``."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: no CUDA GPU is visible to torch; use --device cpu")
    try:
        return torch.device(device)
    except RuntimeError:
        raise UserError(f"--device {device}: expected auto, cpu or cuda[:N]") from None


def resolve_dtype(dtype: str, device):
    """Weight dtype: ``auto`` is bfloat16 on CUDA and float32 on CPU (statistics are always fp32)."""
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise UserError(f"--dtype {dtype}: expected auto, {', '.join(_DTYPES)}")
    return getattr(torch, dtype)
