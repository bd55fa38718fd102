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
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from sharpdraft_theory.checks import json_type

from ..errors import UserError

__all__ = ["read_config", "config_field", "read_weights", "rename_prefixes", "check_and_fill", "build",
           "TrainingLength", "training_length", "MPE_TRUST_LIMIT"]

# A max_position_embeddings of this or more is taken for the target's context copied into the drafter's
# config, not for the length the drafter was trained at (the limit is exclusive: only values below it are
# trusted). Released recipes train drafters at 512-8192 tokens (SpecForge data.max_length 2048-8192,
# speculators --seq-length 8192, EAGLE 2048), while the targets' contexts they copy are 16384-262144
# (SpecForge's Phi-4 head states 16384, Phi-4's own context).
MPE_TRUST_LIMIT = 16384


def read_config(path: str | Path, what: str) -> dict:
    """The parsed ``config.json`` at ``path``; a missing or malformed file is a one-line UserError."""
    path = Path(path)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{what} checkpoint: {path} not found") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except (OSError, UnicodeDecodeError, RecursionError) as e:
        raise UserError(f"{what} checkpoint: cannot read {path} ({getattr(e, 'strerror', None) or e})") from None
    if not isinstance(config, dict):
        raise UserError(f"{path}: expected a JSON object of config fields, got {json_type(config)}; "
                        f"is this a {what} checkpoint?")
    return config


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
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        if st.is_file():
            return load_file(str(st)), st
        if pt.is_file():
            return torch.load(pt, map_location="cpu", weights_only=True), pt
    except (OSError, SafetensorError, RuntimeError, EOFError, ValueError) as err:  # truncated, corrupt, unreadable
        file = st if st.is_file() else pt
        raise UserError(f"{kind} checkpoint {file}: cannot read the weights ({_first_line(err)}); "
                        "is the file complete? download or copy it again") from None
    raise UserError(f"{kind} checkpoint {path}: neither model.safetensors nor pytorch_model.bin found")


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def rename_prefixes(weights: dict[str, torch.Tensor], prefixes: dict[str, str]) -> dict[str, torch.Tensor]:
    """``weights`` with each key starting with a key of ``prefixes`` given that prefix's value instead."""
    renamed = {}
    for key, value in weights.items():
        old = next((p for p in prefixes if key.startswith(p)), None)
        renamed[key if old is None else prefixes[old] + key[len(old):]] = value
    return renamed


def check_and_fill(module: nn.Module, weights: dict[str, torch.Tensor], file: Path, kind: str,
                   optional: dict[str, torch.Tensor] | None = None, ignored: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Match ``weights`` to the module's state dict; UserError names a missing key or a bad shape.

    ``optional`` supplies values for keys the checkpoint may omit. A key the module does not have
    is refused (it could be part of the computation the module would leave out), unless it is
    in ``ignored`` (keys known not to change what runs, e.g. training-only buffers).
    """
    optional = optional or {}
    expected = module.state_dict(keep_vars=True)
    extra = sorted(k for k in weights if k not in expected and k not in ignored)
    if extra:
        raise UserError(f"{kind} checkpoint {file}: weight '{extra[0]}' is not part of the {kind} model this "
                        f"config.json describes; refusing rather than ignoring it" + _more(extra))
    out = {}
    for key, ref in expected.items():
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
          optional: dict[str, torch.Tensor] | None = None, ignored: tuple[str, ...] = (), device=None,
          dtype: torch.dtype | None = None) -> nn.Module:
    """``make()`` on the meta device, filled with ``weights`` (:func:`check_and_fill`), moved to
    ``device`` / ``dtype``, in eval mode."""
    with torch.device("meta"):
        module = make()
    module.load_state_dict(check_and_fill(module, weights, file, kind, optional, ignored), assign=True)
    return module.to(device=device, dtype=dtype).eval()


def _more(keys) -> str:
    return f" (and {len(keys) - 1} more: {', '.join(keys[1:4])}{', ...' if len(keys) > 4 else ''})" if len(keys) > 1 else ""


@dataclass(frozen=True)
class TrainingLength:
    """The drafter's training length, the default ``n_ref``, and where it comes from."""

    value: int | None  # the length; None when nothing trustworthy states it
    origin: str  # one line: the file and field it was read from, or why none is used
    # The largest query-key distance seen in training, where the record states it apart from the key count
    # (training_log.json ``max_distance``: a head whose queries saw few keys drawn from far back). None: the
    # length bounds the distances too, as when every query sees its last keys.
    distance: int | None = None


def training_length(path: Path, max_position_embeddings: int | None, *, trust_mpe: bool) -> TrainingLength:
    """The training length of the drafter checkpoint at ``path``.

    First a training record beside the checkpoint (in its folder):

    * ``training_log.json`` with ``n_ref`` (this project's demo head training script), and
      ``max_distance`` when its queries saw keys farther back than ``n_ref`` (``distance``);
    * ``train_command.txt`` with ``--seq-length N`` (vLLM speculators' training command);
    * a ``*.yaml`` / ``*.yml`` recipe with ``data: {max_length: N}`` (SpecForge) or ``seq_length: N``
      (speculators' ``run.yaml``).

    Without one, ``max_position_embeddings`` when ``trust_mpe`` (the format writes the training
    length there) and it is below :data:`MPE_TRUST_LIMIT`; otherwise ``value`` is None and
    ``origin`` says why.
    """
    record = _training_record(Path(path))
    if record is not None:
        return record
    if max_position_embeddings is None:
        return TrainingLength(None, "the checkpoint has no training record and its config states no length")
    if not trust_mpe:
        return TrainingLength(None, f"the checkpoint has no training record, and this format copies "
                                    f"max_position_embeddings ({max_position_embeddings}) from the target")
    if max_position_embeddings >= MPE_TRUST_LIMIT:
        return TrainingLength(None, f"the checkpoint has no training record, and max_position_embeddings "
                                    f"{max_position_embeddings} is not below {MPE_TRUST_LIMIT}: the target's context "
                                    f"copied over, not a drafter's training length")
    return TrainingLength(max_position_embeddings, f"max_position_embeddings {max_position_embeddings} of config.json "
                                                   f"(no training record beside it)")


def _training_record(folder: Path) -> TrainingLength | None:
    log = folder / "training_log.json"
    if log.is_file():
        record = json.loads(log.read_text())
        value, distance = _positive_int(record.get("n_ref")), _positive_int(record.get("max_distance"))
        if value:
            return TrainingLength(value, f"n_ref {value} of {log}"
                                  + (f", distances up to {distance} (max_distance)" if distance else ""), distance)
    command = folder / "train_command.txt"
    if command.is_file():
        match = re.search(r"--seq[-_]length[ =](\d+)", command.read_text())
        if match:
            return TrainingLength(int(match[1]), f"--seq-length {match[1]} of {command}")
    import yaml

    for recipe in sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")]):
        try:
            data = yaml.safe_load(recipe.read_text())
        except yaml.YAMLError:
            continue
        if not isinstance(data, dict):
            continue
        section = data.get("data") if isinstance(data.get("data"), dict) else {}
        for name, value in (("data.max_length", section.get("max_length")), ("seq_length", data.get("seq_length"))):
            if _positive_int(value):
                return TrainingLength(int(value), f"{name} {value} of {recipe}")
    return None


def _positive_int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
