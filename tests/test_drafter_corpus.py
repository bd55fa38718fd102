"""The corpus of released drafter configs: each loads and matches its float64 reference, or is refused by name.

Every ``config.json`` under ``tests/data/drafter_configs/`` (each with its public source) is shrunk to the
tiny 8-layer target (``test_released_drafters.shrink_decoder``: widths, heads, vocabulary; every field that
changes the computation kept, aux ids mapped onto 8 layers with their convention kept), written as a
random checkpoint in its project's key layout, loaded, and its post-RoPE queries and keys (and, for DFlash,
each row's visible keys) compared with the float64 reference of ``test_released_drafters``. A config may
only be refused when it is listed in ``REFUSED`` with the field named in the message. The field table of
``docs/drafters.md`` is checked against ``calibrate.drafters.fields.docs_table``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from calibrate.drafters import eagle3
from calibrate.drafters.dflash import DFlashConfig, DFlashAdapter, load_dflash
from calibrate.drafters.eagle3 import Eagle3Config
from calibrate.drafters.fields import FORMATS, READ, docs_table
from calibrate.errors import UserError

from test_released_drafters import (CONFIGS, T, collect_calls, reference_dflash, reference_qk, visible_keys_of,
                                    write_dflash, write_eagle)
from tiny_checkpoints import tiny_target

NAMES = sorted(str(p.relative_to(CONFIGS).with_suffix("")) for p in CONFIGS.rglob("*.json"))
# configs refused by design, with the field the message names: P-EAGLE drafts several tokens in one pass from
# a learned mask_hidden feature (SpecForge specforge/modeling/draft/peagle.py), a computation not implemented
REFUSED = {"specforge/qwen3-8b-peagle": "architecture ['PEagleDraftModel']"}


def is_dflash(d: dict) -> bool:
    return "dflash_config" in d or d.get("speculators_model_type") == "dflash"


def tiny_ids(ids: list[int], first_kept: bool) -> list[int]:
    """Aux ids for the 8-layer target, as many as ``ids``: the first id's convention (1 or not) kept."""
    return ([1] if first_kept and ids[0] == 1 else [2]) + [3, 4, 5, 6][:len(ids) - 1]


def shrunk(name: str, vocab: int = 256):
    """The shrunk config (a function for write_eagle's ``edit``) and the hidden_states it must read."""
    d = json.loads((CONFIGS / f"{name}.json").read_text())
    if is_dflash(d):
        return None, None
    section = d.get("eagle_config") or {}
    written = d.get("eagle_aux_hidden_state_layer_ids") or section.get("eagle_aux_hidden_state_layer_ids")
    top = "eagle_aux_hidden_state_layer_ids" in d
    ids = None if written is None else tiny_ids(written, True)
    # reference rules: SGLang reads eagle_config ids + 1 when the first is 1 (PR #25454); vLLM reads top-level ids as is
    expected = (2, 4, 5) if ids is None else tuple(k + (not top and ids[0] == 1) for k in ids)

    def edit(c):
        if ids is not None:
            (c if top else c["eagle_config"])["eagle_aux_hidden_state_layer_ids"] = ids
        scaling = (c.get("transformer_layer_config") or c).get("rope_scaling") or {}
        if scaling.get("mrope_section"):
            scaling["mrope_section"] = [2, 3, 3]  # half of the shrunk head_dim 16, in the same proportions
    return edit, expected


@pytest.fixture(scope="module")
def target():
    return tiny_target(0)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def hidden(target, tokens):
    with torch.no_grad():
        return target(tokens, output_hidden_states=True).hidden_states


def test_corpus_is_large_and_sourced():
    assert len(NAMES) >= 30
    for name in NAMES:
        path = CONFIGS / f"{name}.json"
        assert (path.with_suffix(".source.txt")).is_file() or (path.parent / "SOURCE.txt").is_file(), name


@pytest.mark.parametrize("name", NAMES)
def test_corpus_config_loads_and_matches_or_is_refused_by_name(name, target, tokens, hidden, tmp_path):
    d = json.loads((CONFIGS / f"{name}.json").read_text())
    if name in REFUSED:
        with pytest.raises(UserError, match=REFUSED[name].replace("[", r"\[").replace("]", r"\]")):
            (DFlashConfig if is_dflash(d) else Eagle3Config).from_dict(copy.deepcopy(d))
        return
    if is_dflash(d):
        check_dflash(name, target, tokens, hidden, tmp_path)
    else:
        check_eagle(name, target, tokens, hidden, tmp_path)


def check_eagle(name, target, tokens, hidden, tmp_path):
    edit, expected = shrunk(name)
    path = write_eagle(tmp_path / "head", name, edit=edit)
    head = eagle3.load_eagle3_head(path, target)
    drafter = eagle3.Eagle3Adapter(head, target, tokenizer=None, path=str(path))
    assert drafter.feature_ids == expected
    calls = []
    drafter.collect(tokens, lambda *a: calls.append(a), torch.tensor([5]))
    (_, q, k, _, n_visible), = calls
    d = json.loads((path / "config.json").read_text())
    state = {**load_file(str(path / "model.safetensors")), "embed_tokens.weight": target.get_input_embeddings().weight}
    q_ref, k_ref = reference_qk(d, state, hidden, tokens, expected)
    rows = q.shape[2]
    assert torch.equal(n_visible, torch.arange(1, rows + 1)[None])
    # fp32 head vs float64 reference, O(1) activations (times yarn's a <= 1.5): ~1e-6 per op
    assert torch.allclose(q[0].transpose(0, 1).double(), q_ref[:rows], atol=1e-4)
    assert torch.allclose(k[0].transpose(0, 1).double(), k_ref[:rows], atol=1e-4)


DFLASH_TINY_IDS = [0, 1, 3, 4, 6]  # z-lab ids (layer outputs, h[id + 1]) for the 8-layer target


def check_dflash(name, target, tokens, hidden, tmp_path, p=11):
    from test_released_drafters import DFLASH_IDS
    DFLASH_IDS.setdefault(name, DFLASH_TINY_IDS)
    path = write_dflash(tmp_path / "dflash", name)
    d = json.loads((path / "config.json").read_text())
    model = load_dflash(path, target)
    drafter = DFlashAdapter(model, target, tokenizer=None)
    calls = collect_calls(drafter, tokens, p)
    state = load_file(str(path / "model.safetensors"))
    embed = state.get("embed_tokens.weight", target.get_input_embeddings().weight.detach())
    seen, _ = reference_dflash(d, state, hidden, tokens, p, embed, model.config.hidden_state_ids)
    b = model.config.block_size
    for layer, (q_ref, k_ref) in enumerate(seen):
        mine = [c for c in calls if c[0] == layer]
        rows = torch.cat([c[1] for c in mine], dim=2)[0].transpose(0, 1).double()
        # fp32 model vs float64 reference through up to 8 layers, O(1) activations: ~1e-6 per op
        assert torch.allclose(rows, q_ref, atol=1e-4)
        j = 0
        for _, q, k, _, n_visible in mine:
            for r in range(q.shape[2]):
                keys = visible_keys_of(d, layer, p, j)
                assert int(n_visible[0, r]) == len(keys)
                assert torch.allclose(k[0, :, :len(keys)].transpose(0, 1).double(), k_ref[keys], atol=1e-4)
                j += 1
        assert j == b


def test_every_corpus_field_is_classified():
    """No field of the corpus falls back to the generic refusal: each is read, harmless or refused by name."""
    seen = set()
    for name in NAMES:
        d = json.loads((CONFIGS / f"{name}.json").read_text())
        fmt = "dflash" if is_dflash(d) else "eagle3"
        for section in (d, d.get("dflash_config") or {}, d.get("eagle_config") or {}, d.get("transformer_layer_config") or {}):
            for field in section:
                assert field in FORMATS[fmt], f"{name}: {field}"
                seen.add((fmt, field))
    assert ("eagle3", "target_model_type") in seen and ("eagle3", "decoder_sparse_step") in seen


def test_docs_table_is_generated_from_the_classification():
    docs = (Path(__file__).parent.parent / "docs" / "drafters.md").read_text()
    assert docs_table() in docs, "regenerate with: python -m calibrate.drafters.fields"
    assert all(rule.source for table in FORMATS.values() for rule in table.values())
    assert any(rule.status == READ for rule in FORMATS["pard"].values())
