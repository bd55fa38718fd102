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
