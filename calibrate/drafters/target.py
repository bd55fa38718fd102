"""Causal LMs as targets and drafters: loading them with their tokenizers, and reading their hidden states.

One loader serves every causal LM the adapters need: an ``hf`` / ``pard`` drafter
(``--drafter-path``) and the target of any drafter (``--target-path``; None is the embedded
SmolLM2, ``calibrate.smollm2``). A path is

* a local folder (``config.json`` plus safetensors or ``pytorch_model.bin``) or a ``.gguf`` file;
* a hub id (``org/name``) only when it is not a local path: that is the user asking for the hub.
  Nothing else ever reaches the network.

Every failure is a one-line ``UserError`` naming the option and the path: no such path, no
``config.json``, a weight missing from the checkpoint or of the wrong shape, no tokenizer.

Feature-based drafters (EAGLE-3, DFlash) read the target's hidden states:
:func:`hidden_state_features` keeps only the ones asked for and forms no logits.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from ..errors import UserError
from ..smollm2 import load_smollm2, quiet_transformers

__all__ = ["load_causal_lm", "has_tokenizer", "load_tokenizer", "load_target", "eos_token_id", "hidden_state_features"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def load_causal_lm(path: str, device: torch.device, dtype: torch.dtype, *, option: str):
    """The ``AutoModelForCausalLM`` at ``path`` (``option`` names it in errors), on ``device``, in eval mode.

    On several CUDA GPUs the weights are spread with ``device_map="auto"`` (accelerate).
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    folder, gguf_file, local = _locate(path, option)
    multi_gpu = device.type == "cuda" and torch.cuda.device_count() > 1
    try:
        with quiet_transformers():
            model, info = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=gguf_file, dtype=dtype, local_files_only=local, output_loading_info=True,
                ignore_mismatched_sizes=True, device_map="auto" if multi_gpu else None)
    except (SafetensorError, EOFError) as err:
        raise UserError(f"{option} {path}: cannot read its .safetensors weights ({_first_line(err)}); is the file "
                        "complete? download or copy it again") from None
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        where = "" if local else " (as a hub id; is the name right and the network reachable?)"
        raise UserError(f"{option} {path}: cannot load a causal LM{where}: {_first_line(err)}") from None
    if info["mismatched_keys"]:
        name, got, want = sorted(info["mismatched_keys"])[0]
        raise UserError(f"{option} {path}: weight {name} has shape {list(got)}, the config expects {list(want)}"
                        + _more(info["mismatched_keys"]))
    if info["missing_keys"]:
        name = sorted(info["missing_keys"])[0]
        raise UserError(f"{option} {path}: the checkpoint lacks weight {name}" + _more(info["missing_keys"]))
    if not multi_gpu:
        model = model.to(device)
    return model.eval()


def has_tokenizer(path: str) -> bool:
    """Whether the local folder ``path`` holds tokenizer files of its own."""
    return any((Path(path).expanduser() / f).is_file() for f in _TOKENIZER_FILES)


def load_tokenizer(path: str, *, option: str, shared_with: str | None = None):
    """The tokenizer of the checkpoint at ``path``, else that of the ``--target-path`` folder ``shared_with``
    (drafters share their target's vocabulary); a ``UserError`` when neither has one."""
    from transformers import AutoTokenizer

    folder, gguf_file, local = _locate(path, option)
    candidates = []
    if gguf_file or not local or has_tokenizer(folder):
        candidates.append((folder, gguf_file, local))
    if shared_with is not None:
        target = Path(shared_with).expanduser()
        candidates.append((str(target), None, target.exists()))
    if not candidates:
        raise UserError(f"{option} {path}: no tokenizer files there; pass --target-path with the folder of "
                        "the target model whose tokenizer the drafter shares")
    errors = []
    for where, gguf, is_local in candidates:
        try:
            return AutoTokenizer.from_pretrained(where, gguf_file=gguf, local_files_only=is_local)
        except (OSError, ValueError, KeyError) as err:
            errors.append(f"{where}: {_first_line(err)}")
    raise UserError("cannot load a tokenizer (" + "; ".join(errors) + ")")


def load_target(target_path: str | None, device: torch.device, dtype: torch.dtype):
    """``(model, tokenizer)`` of the target at ``--target-path`` (None: the embedded SmolLM2)."""
    if target_path is None:
        return load_smollm2(device, dtype)
    return (load_causal_lm(target_path, device, dtype, option="--target-path"),
            load_tokenizer(target_path, option="--target-path"))


def eos_token_id(tokenizer) -> int | None:
    """The tokenizer's end-of-sequence id (the first, when it lists several), or None."""
    eos = tokenizer.eos_token_id
    return eos[0] if isinstance(eos, list) else eos


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


def _locate(path: str, option: str) -> tuple[str, str | None, bool]:
    """``(folder or hub id, gguf file name or None, is local)``."""
    local = Path(path).expanduser()
    if local.is_file():
        if local.suffix != ".gguf":
            raise UserError(f"{option} {path}: a file must be a .gguf; otherwise give the checkpoint folder")
        return str(local.parent), local.name, True
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise UserError(f"{option} {path}: no config.json in this folder; is it a checkpoint?")
        return str(local), None, True
    if _HUB_ID.match(path) and not path.startswith((".", "/", "~")):
        return path, None, _hub_cached(path, option)
    raise UserError(f"{option} {path}: no such file or folder")


def _hub_cached(repo_id: str, option: str) -> bool:
    """Whether hub id ``repo_id`` is in the local hub cache (then it loads offline); when it is not,
    a ``UserError`` at once if the hub cannot be reached (offline mode, or no connection within a
    few seconds) rather than a minute of retries."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return True
    if constants.HF_HUB_OFFLINE:
        raise UserError(f"{option} {repo_id}: no such local path, and not in the hub cache (HF_HUB_OFFLINE is set); "
                        "give a checkpoint folder")
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=3).close()
    except OSError as err:
        raise UserError(f"{option} {repo_id}: no such local path, not in the hub cache, and {host} cannot be reached "
                        f"({err.strerror or err}); give a checkpoint folder, or check the name and the network") from None
    return False


def _more(keys) -> str:
    return f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
