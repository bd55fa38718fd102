"""A PARD drafter cut from SmolLM2, stored without the embedding it shares with SmolLM2.

``scripts/train_pard.py`` makes the drafter from decoder layers of its base model (SmolLM2-135M-
Instruct by default) plus the base's embedding, final norm and LM head; the embedding and the LM head
(tied in SmolLM2: 28M of its weights) stay frozen, so the folder keeps only what trained:

* ``config.json``: the base's Llama config with ``num_hidden_layers`` cut to the drafter's layers,
  ``pard_token`` (the mask token), ``max_seq_length`` (the training length: the drafter's n_ref),
  ``sharpdraft_embedding_from`` (``"smollm2"``, or the base folder a ``--base`` run was cut from) and
  ``sharpdraft_layers_from`` (which of the base's layers the drafter's started as);
* ``model.safetensors``: ``model.layers.*`` and ``model.norm.weight`` only (float32; 57 MB at 4
  layers of SmolLM2);
* ``training_log.json``.

:func:`build_pard_drafter` puts the drafter back together: a ``LlamaForCausalLM`` with the base's
embedding (and LM head) and the folder's tensors, every name and shape checked, which drafts through
``calibrate.drafters.parallel.PardParallelProposer`` as any PARD drafter does. Such a folder is not a
whole checkpoint: ``AutoModelForCausalLM.from_pretrained`` alone would miss the embedding.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from ..errors import UserError

__all__ = ["EMBEDDING_FROM", "LAYERS_FROM", "SMOLLM2", "SMOLLM2_LAYERS", "SMOLLM2_VOCAB", "layers_from",
           "cut_drafter", "trained_state", "build_pard_drafter", "cut_from_smollm2"]

EMBEDDING_FROM = "sharpdraft_embedding_from"  # config field: where the embedding and LM head come from
LAYERS_FROM = "sharpdraft_layers_from"  # config field: the base layers the drafter's layers started as
SMOLLM2 = "smollm2"
SMOLLM2_LAYERS = 30
SMOLLM2_VOCAB = 49152


def layers_from(layers: int, last: int, base_layers: int) -> list[int]:
    """The base layers a drafter of ``layers`` decoder layers starts from: the first ``layers - last``, then
    the base's last ``last`` (``last`` 0: the first ``layers``)."""
    if not 1 <= layers <= base_layers or not 0 <= last <= layers:
        raise ValueError(f"{layers} layers ({last} of them last) do not fit a base of {base_layers} layers")
    return list(range(layers - last)) + list(range(base_layers - last, base_layers))


def _is_trained(name: str) -> bool:
    return name.startswith("model.layers.") or name == "model.norm.weight"


def cut_drafter(base, source_layers: list[int], pard_token: int, max_seq_length: int, embedding_from: str):
    """A float32 ``LlamaForCausalLM`` made of ``base``'s embedding, its decoder layers ``source_layers`` (in
    that order, renumbered from 0), its final norm and its LM head, weights copied; the config names
    ``pard_token``, ``max_seq_length`` and the two fields of the module docstring."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(base.config)
    config.num_hidden_layers = len(source_layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in source_layers]
    config.pard_token = int(pard_token)
    config.max_seq_length = int(max_seq_length)
    config.spd_type = "pard"
    setattr(config, EMBEDDING_FROM, str(embedding_from))
    setattr(config, LAYERS_FROM, [int(i) for i in source_layers])
    with torch.random.fork_rng(devices=[]):  # the random init is overwritten; leave the caller's RNG alone
        drafter = AutoModelForCausalLM.from_config(config)
    state = {}
    for name, value in base.state_dict().items():
        if name.startswith("model.layers."):
            index, rest = name[len("model.layers."):].split(".", 1)
            if int(index) in source_layers:
                state[f"model.layers.{source_layers.index(int(index))}.{rest}"] = value
        else:
            state[name] = value
    result = drafter.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(f"the base model's weights do not fit the cut: missing {result.missing_keys[:3]}, "
                         f"unexpected {result.unexpected_keys[:3]}")
    drafter.tie_weights()
    return drafter.float().eval()


def trained_state(model) -> dict[str, torch.Tensor]:
    """The tensors a drafter folder keeps: its decoder layers and final norm (float32, on the CPU)."""
    return {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items() if _is_trained(k)}


def cut_from_smollm2(path: str | None) -> bool:
    """Whether ``path`` is a folder whose config says its drafter was cut from SmolLM2 (so SmolLM2 is its
    target); False for anything else, unreadable configs included (they are refused when loaded)."""
    if path is None:
        return False
    try:
        config = json.loads((Path(path).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(config, dict) and config.get(EMBEDDING_FROM) == SMOLLM2


def _base_model(config: dict, folder: Path):
    """The model whose embedding (and LM head) the drafter uses, from the config's marker."""
    source = config.get(EMBEDDING_FROM)
    if source == SMOLLM2:
        from ..smollm2 import load_smollm2

        return load_smollm2()[0]
    if isinstance(source, str) and (Path(source) / "config.json").is_file():
        from .target import load_causal_lm

        return load_causal_lm(source, torch.device("cpu"), torch.float32,
                              option=f"PARD drafter {folder}: its {EMBEDDING_FROM}")
    raise UserError(f"PARD drafter {folder}: config.json has {EMBEDDING_FROM} {source!r}, neither 'smollm2' nor a "
                    "model folder; it names where the drafter's embedding comes from (scripts/train_pard.py writes it)")


def build_pard_drafter(folder, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, base=None):
    """The ``LlamaForCausalLM`` of a ``scripts/train_pard.py`` folder, in eval mode on ``device``: the base's
    embedding and LM head (``base``, else the model the config's ``sharpdraft_embedding_from`` names) with
    the folder's decoder layers and final norm. ``UserError`` naming the first problem: a missing file or
    field, a missing, extra or misshapen tensor, a base of another width or vocabulary."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = Path(folder).expanduser()
    config_path, weights_path = folder / "config.json", folder / "model.safetensors"
    for path in (config_path, weights_path):
        if not path.is_file():
            raise UserError(f"PARD drafter {folder}: no {path.name}; give a folder written by scripts/train_pard.py")
    try:
        fields = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"PARD drafter {folder}: cannot read config.json ({err})") from None
    if not isinstance(fields, dict) or fields.get("model_type") != "llama":
        raise UserError(f"PARD drafter {folder}: config.json is not a Llama config (model_type "
                        f"{fields.get('model_type') if isinstance(fields, dict) else None!r})")
    layers = fields.get("num_hidden_layers")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise UserError(f"PARD drafter {folder}: config.json has num_hidden_layers {layers!r}; expected at least 1")
    token = fields.get("pard_token")
    vocab = fields.get("vocab_size")
    if not isinstance(token, int) or isinstance(token, bool) or not isinstance(vocab, int) or not 0 <= token < vocab:
        raise UserError(f"PARD drafter {folder}: config.json has pard_token {token!r}, not a token id below its "
                        f"vocab_size {vocab!r}")
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError) as err:
        raise UserError(f"PARD drafter {folder}: cannot read model.safetensors ({err}); is the file "
                        "complete?") from None

    config = LlamaConfig.from_dict({k: v for k, v in fields.items() if k != "transformers_version"})
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(config)
    expected = {k: v.shape for k, v in model.state_dict().items() if _is_trained(k)}
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing:
        raise UserError(f"PARD drafter {folder}: model.safetensors lacks {missing[0]}"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                        + f"; the config states {layers} layers")
    if extra:
        raise UserError(f"PARD drafter {folder}: model.safetensors holds {extra[0]}, which a {layers}-layer drafter "
                        "does not have; only its decoder layers and final norm belong there")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != tuple(shape):
            raise UserError(f"PARD drafter {folder}: {name} has shape {list(tensors[name].shape)}, the config "
                            f"expects {list(shape)}")
    if base is None:  # the folder is sound: now the (larger) base model
        base = _base_model(fields, folder)
    bc = base.config.get_text_config()
    for name in ("hidden_size", "vocab_size"):
        if getattr(bc, name) != fields.get(name):
            raise UserError(f"PARD drafter {folder}: {name} {fields.get(name)!r}, its base model has "
                            f"{getattr(bc, name)}; the drafter's embedding must be its base's")
    state = {k: v.float() for k, v in tensors.items()}
    state["model.embed_tokens.weight"] = base.get_input_embeddings().weight.detach().float()
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = base.get_output_embeddings().weight.detach().float()
    result = model.load_state_dict(state, strict=False)
    left = [k for k in result.missing_keys if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if left or result.unexpected_keys:  # the checks above leave nothing to miss; a guard against silent init
        raise UserError(f"PARD drafter {folder}: weights not filled: {(left + result.unexpected_keys)[:3]}")
    model.tie_weights()
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        module.weight.requires_grad_(False)
    return model.to(device=device, dtype=dtype).eval()
