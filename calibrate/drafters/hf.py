"""``hf`` and ``pard`` drafters: any ``AutoModelForCausalLM``, tapped through ``AttentionInterface``.

PARD drafters (AMD-AGI/PARD) are plain causal LMs whose config adds a ``pard_token``; for
calibration they run exactly like any causal LM: one causal prefill per sequence, every query
row ``i`` sees ``i + 1`` keys. Only the base model runs (no ``lm_head``), since the logits over
the vocabulary are not needed.

Loading (``load``):

* no ``--drafter-path`` with ``--drafter hf``: the embedded SmolLM2-135M-Instruct
  (``calibrate.smollm2``);
* a local folder (``config.json`` plus safetensors or ``pytorch_model.bin``) or a ``.gguf`` file;
* a hub id (``org/name``) only when it is not a local path: that is the user asking for the
  hub. Nothing else ever reaches the network.

Tokenizer: the drafter folder's own tokenizer files, else the ``--target-path`` folder's (PARD
and other drafters share their target's vocabulary); with neither, a ``UserError`` says so.

Default ``n_ref`` (the reference length; ``--n-ref`` overrides it):

* embedded SmolLM2: 2048, its pre-training context;
* ``hf``: the config's ``max_position_embeddings`` (the only length a config states; pass
  ``--n-ref`` with the real training length when you know it);
* ``pard``: the config's ``max_seq_length`` if present, else 512, the length of PARD's example
  training recipes.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from sharpdraft_theory.spec import DrafterInfo

from ..errors import UserError
from ..smollm2 import SMOLLM2_N_REF, load_smollm2, quiet_transformers
from ..taps import attention_tap
from .base import AttentionTap

__all__ = ["CausalLMDrafter", "load", "PARD_N_REF"]

PARD_N_REF = 512  # PARD's example recipes train at max_seq_length 512
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


class CausalLMDrafter:
    """A causal LM as a drafter: the ``Drafter`` protocol of ``calibrate.drafters.base``."""

    def __init__(self, model, tokenizer, *, kind: str, path: str | None, default_n_ref: int):
        self.model = model
        self.tokenizer = tokenizer
        self.kind = kind
        self.default_n_ref = int(default_n_ref)
        cfg = model.config.get_text_config()
        heads = cfg.num_attention_heads
        self.info = DrafterInfo(kind=kind, path=path, num_layers=cfg.num_hidden_layers, num_heads=heads,
                                num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                                head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        self.device = model.get_input_embeddings().weight.device
        eos = tokenizer.eos_token_id
        self.eos_token_id = eos[0] if isinstance(eos, list) else eos

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def collect(self, input_ids: torch.Tensor, tap: AttentionTap, positions: torch.Tensor) -> None:
        """One causal prefill of ``input_ids`` (1, T); the tap keeps the rows it wants."""
        with torch.no_grad(), attention_tap(self.model, tap):
            self.model.base_model(input_ids=input_ids.to(self.device), use_cache=False)


def load(kind: str, drafter_path: str | None, target_path: str | None, device: torch.device,
         dtype: torch.dtype) -> CausalLMDrafter:
    """Load an ``hf`` or ``pard`` drafter (see the module docstring for paths and presets)."""
    if drafter_path is None:
        if kind != "hf":
            raise UserError(f"--drafter {kind} needs --drafter-path (a local checkpoint folder or a hub id)")
        model, tokenizer = load_smollm2(device, dtype)
        return CausalLMDrafter(model, tokenizer, kind="hf", path=None, default_n_ref=SMOLLM2_N_REF)
    folder, gguf_file, local = _locate(drafter_path)
    model = _load_model(drafter_path, folder, gguf_file, local, device, dtype)
    tokenizer = _load_tokenizer(drafter_path, folder, gguf_file, local, target_path)
    return CausalLMDrafter(model, tokenizer, kind=kind, path=drafter_path,
                           default_n_ref=_default_n_ref(kind, model.config))


def _locate(drafter_path: str) -> tuple[str, str | None, bool]:
    """``(folder or hub id, gguf file name or None, is local)``."""
    path = Path(drafter_path).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise UserError(f"--drafter-path {drafter_path}: a file must be a .gguf; otherwise give the checkpoint folder")
        return str(path.parent), path.name, True
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"--drafter-path {drafter_path}: no config.json in this folder; is it a checkpoint?")
        return str(path), None, True
    if _HUB_ID.match(drafter_path) and not drafter_path.startswith((".", "/", "~")):
        return drafter_path, None, False
    raise UserError(f"--drafter-path {drafter_path}: no such file or folder")


def _load_model(shown: str, folder: str, gguf_file: str | None, local: bool, device: torch.device,
                dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    multi_gpu = device.type == "cuda" and torch.cuda.device_count() > 1
    try:
        with quiet_transformers():
            model, info = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=gguf_file, dtype=dtype, local_files_only=local, output_loading_info=True,
                ignore_mismatched_sizes=True, device_map="auto" if multi_gpu else None)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        where = "" if local else " (as a hub id; is the name right and the network reachable?)"
        raise UserError(f"--drafter-path {shown}: cannot load a causal LM{where}: {_first_line(err)}") from None
    if info["mismatched_keys"]:
        name, got, want = sorted(info["mismatched_keys"])[0]
        raise UserError(f"--drafter-path {shown}: weight {name} has shape {list(got)}, the config expects {list(want)}"
                        + _more(info["mismatched_keys"]))
    if info["missing_keys"]:
        name = sorted(info["missing_keys"])[0]
        raise UserError(f"--drafter-path {shown}: the checkpoint lacks weight {name}" + _more(info["missing_keys"]))
    if not multi_gpu:
        model = model.to(device)
    return model.eval()


def _load_tokenizer(shown: str, folder: str, gguf_file: str | None, local: bool, target_path: str | None):
    from transformers import AutoTokenizer

    candidates = []
    if gguf_file or not local or any((Path(folder) / f).is_file() for f in _TOKENIZER_FILES):
        candidates.append((folder, gguf_file, local))
    if target_path is not None:
        target = Path(target_path).expanduser()
        candidates.append((str(target), None, target.exists()))
    if not candidates:
        raise UserError(f"--drafter-path {shown}: no tokenizer files there; pass --target-path with the folder of "
                        "the target model whose tokenizer the drafter shares")
    errors = []
    for where, gguf, is_local in candidates:
        try:
            return AutoTokenizer.from_pretrained(where, gguf_file=gguf, local_files_only=is_local)
        except (OSError, ValueError, KeyError) as err:
            errors.append(f"{where}: {_first_line(err)}")
    raise UserError("cannot load a tokenizer (" + "; ".join(errors) + ")")


def _default_n_ref(kind: str, config) -> int:
    cfg = config.get_text_config()
    if kind == "pard":
        return int(getattr(cfg, "max_seq_length", None) or PARD_N_REF)
    return int(cfg.max_position_embeddings)


def _more(keys) -> str:
    return f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
