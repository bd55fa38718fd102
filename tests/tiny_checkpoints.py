"""Tiny random targets and drafter checkpoints in the official layouts, for tests of every layer.

Everything here is deterministic in ``seed`` and small enough to build in milliseconds on a CPU:
a 8-layer Llama target (EAGLE-3 needs at least 7 layers for distinct feature layers), and
EAGLE-3 / DFlash checkpoints written as ``config.json`` + ``model.safetensors`` with exactly the
key names and shapes that the released checkpoints use.

Example
-------
>>> import tempfile
>>> from calibrate.drafters.eagle3 import load_eagle3_head
>>> target = tiny_target(0)
>>> with tempfile.TemporaryDirectory() as d:
...     _ = write_tiny_eagle3(d, target, seed=1)
...     head = load_eagle3_head(d, target)
>>> head.config.hidden_size, head.lm_head.weight.shape[0]
(64, 128)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

__all__ = ["tiny_target", "write_tiny_eagle3", "tiny_eagle3_head", "write_tiny_dflash", "corrupt_checkpoint"]


def tiny_target(seed: int = 0, num_layers: int = 8, vocab_size: int = 256):
    """A tiny random ``LlamaForCausalLM``: hidden 64, 4 heads, 2 KV heads (GQA), ``num_layers`` layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6,
                         initializer_range=0.1, tie_word_embeddings=False, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()


def _random_state(module: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Random floating weights for every parameter of ``module`` (built on the meta device).

    Linear weights ~ N(0, 1/fan_in) so that activations keep unit scale and attention logits are
    far from uniform; norm weights ~ 1 + N(0, 0.1^2).
    """
    g = torch.Generator().manual_seed(seed)
    state = {}
    for key, ref in sorted(module.state_dict().items()):
        if not ref.dtype.is_floating_point:
            continue
        if ref.dim() == 1:
            state[key] = 1.0 + 0.1 * torch.randn(ref.shape, generator=g)
        else:
            state[key] = torch.randn(ref.shape, generator=g) * ref.shape[-1] ** -0.5
    return state


def _write(directory, config: dict, state: dict[str, torch.Tensor]) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    return directory


def write_tiny_eagle3(directory, target, seed: int = 0, *, hidden_size: int | None = None,
                      draft_vocab_size: int = 128, max_position_embeddings: int = 64,
                      include_embed: bool = False) -> Path:
    """Write a random EAGLE-3 head for ``target`` in the official layout; return the directory.

    Keys: ``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t`` (int64),
    ``t2d`` (bool), and ``embed_tokens.weight`` only when ``include_embed`` (or when the head's
    width differs from the target's, as EAGLE then cannot borrow the target's embedding).
    The draft vocabulary is a random sorted subset of the target's: ``d2t[i] = used[i] - i``.
    """
    from calibrate.drafters.eagle3 import Eagle3Config, Eagle3Head

    tc = target.config
    hidden = hidden_size or tc.hidden_size
    config = Eagle3Config(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=2 * hidden, vocab_size=tc.vocab_size,
                          draft_vocab_size=draft_vocab_size, max_position_embeddings=max_position_embeddings,
                          rms_norm_eps=1e-6, rope_theta=10000.0, target_hidden_size=tc.hidden_size)
    with torch.device("meta"):
        head = Eagle3Head(config)
    state = _random_state(head, seed)
    if not include_embed and hidden == tc.hidden_size:
        del state["embed_tokens.weight"]
    g = torch.Generator().manual_seed(seed + 1)
    used = torch.randperm(tc.vocab_size, generator=g)[:draft_vocab_size].sort().values
    state["d2t"] = used - torch.arange(draft_vocab_size)
    t2d = torch.zeros(tc.vocab_size, dtype=torch.bool)
    t2d[used] = True
    state["t2d"] = t2d
    return _write(directory, config.to_dict(), state)


def tiny_eagle3_head(target, seed: int = 0, draft_vocab_size: int = 128, **options):
    """A random EAGLE-3 head for ``target`` in memory (float32, eval mode), with any ``Eagle3Config`` options.

    Options only other layouts carry (``qk_norm``, ``sliding_window``, ...) have no EAGLE-layout
    ``config.json``; this builds the module itself, with the target's embedding and weights drawn as
    :func:`write_tiny_eagle3` draws them.
    """
    from calibrate.drafters.eagle3 import Eagle3Config, Eagle3Head

    tc = target.config
    config = Eagle3Config(hidden_size=tc.hidden_size, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=2 * tc.hidden_size, vocab_size=tc.vocab_size,
                          draft_vocab_size=draft_vocab_size, rope_theta=10000.0, **options)
    head = Eagle3Head(config, embed_tokens=target.get_input_embeddings())
    g = torch.Generator().manual_seed(seed + 1)
    used = torch.randperm(tc.vocab_size, generator=g)[:draft_vocab_size].sort().values
    with torch.no_grad():
        state = {k: v for k, v in _random_state(head, seed).items() if not k.startswith("embed_tokens")}
        head.load_state_dict(state, strict=False)
        head.d2t.copy_(used - torch.arange(draft_vocab_size))
        head.t2d.zero_()
        head.t2d[used] = True
    return head.eval()


def write_tiny_dflash(directory, target, seed: int = 0, *, num_layers: int = 2, block_size: int = 4,
                      target_layer_ids=(1, 3, 5), mask_token_id: int | None = None,
                      nested: bool = True) -> Path:
    """Write a random DFlash draft model for ``target`` in z-lab/dflash's layout; return the directory.

    Keys: ``fc.weight`` [H, len(ids) * H], ``hidden_norm.weight``, ``layers.{i}.self_attn.{q,k,v,o}_proj
    .weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``,
    ``layers.{i}.{input,post_attention}_layernorm.weight``, ``norm.weight``. ``block_size``,
    ``mask_token_id`` and ``target_layer_ids`` go under ``dflash_config`` (``nested``) or top level.
    """
    from calibrate.drafters.dflash import DFlashConfig, DFlashDraftModel

    tc = target.config
    mask = tc.vocab_size - 1 if mask_token_id is None else mask_token_id
    config = DFlashConfig(hidden_size=tc.hidden_size, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=tc.hidden_size // 4, intermediate_size=2 * tc.hidden_size,
                          num_hidden_layers=num_layers, vocab_size=tc.vocab_size, rms_norm_eps=1e-6,
                          rope_theta=10000.0, block_size=block_size, mask_token_id=mask,
                          target_layer_ids=tuple(target_layer_ids), num_target_layers=tc.num_hidden_layers)
    with torch.device("meta"):
        model = DFlashDraftModel(config)
    return _write(directory, config.to_dict(nested=nested), _random_state(model, seed))


def corrupt_checkpoint(src: Path, dst: Path, edit_weights=None, edit_config=None) -> Path:
    """Copy the checkpoint at ``src`` (config.json + model.safetensors) to ``dst``, editing it on the way.

    ``edit_weights(state_dict)`` and ``edit_config(config_dict)`` change their argument in place;
    tests use this to build malformed checkpoints (a missing key, a wrong shape, a bad field).
    """
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    weights = load_file(str(Path(src) / "model.safetensors"))
    config = json.loads((Path(src) / "config.json").read_text())
    if edit_weights:
        edit_weights(weights)
    if edit_config:
        edit_config(config)
    (dst / "config.json").write_text(json.dumps(config))
    save_file(weights, str(dst / "model.safetensors"))
    return dst
