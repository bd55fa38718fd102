"""``sharpdraft export``: a drafter, its target and a spec, as folders vLLM loads and serves (docs/serving.md).

Writes ``OUT/target`` (the target with ``architectures`` named and a tied embedding stored as
``model.embed_tokens.weight``: vLLM's Llama loader skips ``lm_head.*`` when embeddings are tied),
``OUT/drafter`` (the EAGLE-3 head with ``max_position_embeddings`` raised to the serving length: vLLM
takes that field as the drafter's maximum length and silently stops drafting past it; the spec keeps
``n_ref``), ``OUT/spec.json`` (the spec, checked servable), and ``OUT/vllm.json`` (the ``LLM(...)``
arguments and the environment; float32, the weights' own precision: vLLM's ``auto`` would halve it), built in a temporary folder beside ``OUT`` and renamed into place.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import tempfile
from pathlib import Path
from typing import Annotated, Optional

import typer

from .errors import UserError

__all__ = ["export"]

SERVED = "eagle3"  # the one drafter kind vLLM's EAGLE-3 path serves and the plugin scales


def export(
    *,
    out: Annotated[Path, typer.Option("--out", help="Folder to write (must not exist, or be empty).")],
    drafter: Annotated[str, typer.Option(help="Drafter kind; vLLM serves eagle3.")] = SERVED,
    drafter_path: Annotated[Optional[str], typer.Option("--drafter-path", help="EAGLE-3 head folder (default: the "
                                                                               "packaged SmolLM2 demo head).")] = None,
    target_path: Annotated[Optional[str], typer.Option("--target-path", help="Target model folder (default: the "
                                                                             "built-in SmolLM2).")] = None,
    spec: Annotated[Optional[Path], typer.Option(help="Scale spec to serve with (default: none; the drafter as "
                                                      "it is).")] = None,
    max_length: Annotated[Optional[int], typer.Option("--max-length", help="Serving length, vLLM's max_model_len "
                                                      "(default: the target's max_position_embeddings).")] = None,
    num_draft: Annotated[int, typer.Option("--num-draft", help="Tokens drafted per step "
                                                               "(num_speculative_tokens).")] = 3,
) -> None:
    """Write a drafter, its target and a spec as folders vLLM serves, and print the call and server command."""
    from .drafters.eagle3 import DEMO_HEAD_DIR, Eagle3Config
    from .drafters.pointer import FILE as POINTER

    if drafter != SERVED:
        raise UserError(f"--drafter {drafter}: vLLM serves EAGLE-3 heads here (speculative method eagle3, the "
                        "drafter the plugin scales); export an eagle3 head")
    if not 1 <= num_draft <= 16:
        raise UserError(f"--num-draft {num_draft}: expected 1 to 16 drafted tokens per step")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out}: {'a file' if not out.is_dir() else 'a folder with files'} is there; "
                        "give a new folder")
    head = Path(drafter_path) if drafter_path is not None else DEMO_HEAD_DIR
    if (head / POINTER).is_file():
        raise UserError(f"--drafter-path {head}: has a copy pointer ({POINTER}), which vLLM does not serve; "
                        "export the head it joins alone")
    if not (head / "config.json").is_file():
        raise UserError(f"--drafter-path {head}: no config.json; give an EAGLE-3 head folder")
    config = Eagle3Config.from_json(head / "config.json")
    served_spec = None if spec is None else _servable_spec(spec, config.num_attention_heads)
    if max_length is not None and max_length < 2:
        raise UserError(f"--max-length {max_length}: expected at least 2 tokens")
    import torch

    from .drafters.target import load_target

    target, tokenizer = load_target(target_path, torch.device("cpu"), torch.float32)
    length = target.config.max_position_embeddings if max_length is None else max_length
    if length > target.config.max_position_embeddings:
        raise UserError(f"--max-length {length}: above the target's max_position_embeddings "
                        f"{target.config.max_position_embeddings}")
    if (config.vocab_size, config.target_hidden_size) != (target.config.vocab_size, target.config.hidden_size):
        raise UserError(f"--drafter-path {head}: the head reads a target of vocabulary {config.vocab_size} and width "
                        f"{config.target_hidden_size}, the target has {target.config.vocab_size} and "
                        f"{target.config.hidden_size}; is this the head's target?")
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        _write_target(tmp / "target", target, tokenizer)
        _write_drafter(tmp / "drafter", head, length)
        if served_spec is not None:
            shutil.copyfile(spec, tmp / "spec.json")
        call = {"model": str(out / "target"), "dtype": "float32", "max_model_len": length,
                "speculative_config": {"method": SERVED, "model": str(out / "drafter"),
                                       "num_speculative_tokens": num_draft},
                "env": {} if served_spec is None else {"SHARPDRAFT_SPEC": str(out / "spec.json")}}
        (tmp / "vllm.json").write_text(json.dumps(call, indent=1) + "\n")
        if out.is_dir():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    typer.echo(_instructions(out, call))


def _servable_spec(path: Path, heads: int):
    """The spec at ``path`` if vLLM can apply it to a one-layer head of ``heads`` heads; else a UserError."""
    from sharpdraft_runtime.serving import load_spec
    from sharpdraft_theory import SpecError

    try:
        spec = load_spec(path)
        spec.check_fits(1, heads, "the EAGLE-3 head")
    except SpecError as err:
        raise UserError(f"--spec: {err}") from None
    return spec


def _write_target(folder: Path, model, tokenizer) -> None:
    """The target as vLLM loads it: ``architectures`` named, a tied embedding stored under its own name."""
    from safetensors.torch import save_file
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    folder.mkdir()
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    if not config.get("architectures"):
        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type"))
        if name is None:
            raise UserError(f"the target's config names no architectures and its model_type "
                            f"{config.get('model_type')!r} has no causal-LM class to name")
        config["architectures"] = [name]
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):  # one tensor, under the name vLLM loads
        tensors["model.embed_tokens.weight"] = tensors.pop("lm_head.weight", tensors.get("model.embed_tokens.weight"))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    tokenizer.save_pretrained(folder)


def _write_drafter(folder: Path, head: Path, length: int) -> None:
    """The head's weights as they are, its config with ``max_position_embeddings`` at the serving length."""
    folder.mkdir()
    config = json.loads((head / "config.json").read_text())
    config["max_position_embeddings"] = max(length, config.get("max_position_embeddings") or 0)
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    weights = sorted(head.glob("*.safetensors")) + sorted(head.glob("*.bin")) + sorted(head.glob("*.index.json"))
    for path in weights:
        shutil.copyfile(path, folder / path.name)


def _instructions(out: Path, call: dict) -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in call["env"].items())
    env = env + " " if env else ""
    spec_config = json.dumps(call["speculative_config"])
    return (f"wrote {out}: target/, drafter/{', spec.json' if call['env'] else ''}, vllm.json. Serve it "
            f"(docs/serving.md; vLLM's CPU build: `make vllm`):\n"
            f"  offline, in a script under `if __name__ == \"__main__\":`, run with {env.strip() or 'no SHARPDRAFT_SPEC'}:\n"
            f"    from vllm import LLM\n"
            f"    llm = LLM(model={call['model']!r}, speculative_config={spec_config}, "
            f"dtype={call['dtype']!r}, max_model_len={call['max_model_len']}, enforce_eager=True)\n"
            f"  server:\n"
            f"    {env}python -m vllm.entrypoints.openai.api_server --model {shlex.quote(call['model'])} "
            f"--speculative-config {shlex.quote(spec_config)} --dtype {call['dtype']} --max-model-len {call['max_model_len']} "
            "--enforce-eager")
