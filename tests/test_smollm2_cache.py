"""The converted copy of SmolLM2 that later loads read: exactly the GGUF model, written atomically or not at all."""

from __future__ import annotations

import pydoc_data.topics

import pytest
import torch

from calibrate import smollm2


def test_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARPDRAFT_CACHE", "off")
    assert smollm2.smollm2_cache_dir() is None
    monkeypatch.setenv("SHARPDRAFT_CACHE", str(tmp_path))
    folder = smollm2.smollm2_cache_dir()
    assert folder.parent == tmp_path and folder.name.startswith("smollm2-135m-instruct-f32-")
    monkeypatch.delenv("SHARPDRAFT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert smollm2.smollm2_cache_dir().parent == tmp_path / "xdg" / "sharpdraft"


def test_an_unwritable_cache_is_skipped_without_a_word(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    # The parent is a file: nothing can be created under it, and nothing is raised.
    assert smollm2.save_converted(blocker / "copy", model=None, tokenizer=None) is False
    assert blocker.read_text() == "not a folder"


@pytest.mark.slow
def test_the_converted_copy_is_the_gguf_model_exactly(tmp_path):
    model, tokenizer = smollm2.load_smollm2_gguf(torch.float32)
    folder = tmp_path / "copy"
    assert smollm2.save_converted(folder, model, tokenizer)
    assert not [p for p in tmp_path.iterdir() if p != folder]  # no temporary folder left behind
    copy, copy_tok = smollm2.load_converted(folder, torch.float32)
    copy.eval()

    text = pydoc_data.topics.topics["assert"][:4000]
    ids = tokenizer(text)["input_ids"]
    assert copy_tok(text)["input_ids"] == ids
    assert (copy_tok.eos_token_id, copy_tok.bos_token_id) == (tokenizer.eos_token_id, tokenizer.bos_token_id)
    x = torch.tensor([ids[:256]])
    with torch.no_grad():
        # Same float32 weights, same kernels, same order: bit-identical logits, no tolerance needed.
        assert torch.equal(copy(x).logits, model(x).logits)


def test_an_unreadable_copy_is_removed_so_the_next_load_rebuilds_it(tmp_path):
    folder = tmp_path / "copy"
    folder.mkdir()
    (folder / "config.json").write_text("{not json")
    (folder / "model.safetensors").write_bytes(b"cut short")
    assert smollm2.load_converted(folder) is None
    assert not folder.exists()
    assert smollm2.load_converted(tmp_path / "never-written") is None


def _tiny_copy(folder):
    """A converted copy of a tiny Llama and a byte tokenizer, written as the SmolLM2 copy is."""
    from test_calibrate import _write_causal_lm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = _write_causal_lm(folder.parent / "source")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(source), AutoTokenizer.from_pretrained(source)
    assert smollm2.save_converted(folder, model, tokenizer)
    return model


def test_an_edited_copy_is_not_trusted_but_rebuilt(tmp_path):
    """A config.json edited after the copy was written (2 layers cut to 1) fails the fingerprint: the copy is
    removed, so the next load converts the GGUF file again, instead of loading another model under its name."""
    import json

    folder = tmp_path / "copy"
    model = _tiny_copy(folder)
    loaded, _ = smollm2.load_converted(folder)
    assert loaded.config.num_hidden_layers == model.config.num_hidden_layers == 2  # an intact copy is read
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    assert smollm2.load_converted(folder) is None
    assert not folder.exists()


def test_a_copy_with_other_weights_is_not_trusted(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "copy"
    _tiny_copy(folder)
    weights = load_file(folder / "model.safetensors")
    weights.pop(sorted(weights)[-1])  # one tensor fewer: another header
    save_file(weights, folder / "model.safetensors")
    assert smollm2.load_converted(folder) is None


@pytest.mark.parametrize("value", ["false", "no", "0", "none", "true", "cache"])
def test_the_cache_variable_takes_only_off_or_a_path(monkeypatch, value):
    from calibrate.errors import UserError

    monkeypatch.setenv("SHARPDRAFT_CACHE", value)
    with pytest.raises(UserError, match=f"SHARPDRAFT_CACHE={value}: expected off .* or a folder path"):
        smollm2.smollm2_cache_dir()


@pytest.mark.parametrize("value", ["./cache", "~/cache", "a/b"])
def test_a_relative_path_is_a_path(monkeypatch, value):
    monkeypatch.setenv("SHARPDRAFT_CACHE", value)
    assert smollm2.smollm2_cache_dir().parent.name in ("cache", "b")
