"""``sharpdraft generate``: batched target generation, resumable per prompt, cut at end markers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from calibrate.errors import UserError
from calibrate.generate import GenerateOptions, _cut, read_generations, run_generation, tokenizer_identity
from calibrate.workloads import Prompt, chat_ids, load_workload

from test_calibrate import _write_causal_lm

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return _write_causal_lm(tmp_path_factory.mktemp("tiny"))


def _workload(tmp_path: Path) -> str:
    path = tmp_path / "w.jsonl"
    lines = [{"id": "a", "prompt": "Tell me a story."}, {"id": "b", "prompt": "Count to ten, please.", "end": "zz"},
             {"id": "c", "prompt": "Why?"}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def _opts(tmp_path, tiny, **over) -> GenerateOptions:
    base = dict(workload=_workload(tmp_path), out=tmp_path / "g", new_tokens=12, batch=2, target_path=str(tiny))
    return GenerateOptions(**(base | over))


def test_a_run_writes_each_prompt_and_a_resumed_run_gives_the_same_text(tmp_path, tiny):
    opts = _opts(tmp_path, tiny)
    first = run_generation(opts)
    assert [g.id for g in first] == ["a", "b", "c"]
    assert all(0 < len(g.output_ids) <= 12 for g in first)
    run = json.loads((opts.out / "run.json").read_text())
    assert run["settings"]["temperature"] == 0.8 and run["settings"]["workload"]["ids"] == ["a", "b", "c"]
    (opts.out / "prompts" / "c.json").unlink()  # c decodes alone in the second batch
    (opts.out / "prompts" / "b.json").unlink()  # b shares the first batch with a, which stays written
    again = run_generation(GenerateOptions(**(vars(opts) | {"resume": True})))
    assert again[2].output_ids == first[2].output_ids  # same batch, same seed: the same sample
    assert again[1].prompt_ids == first[1].prompt_ids and again[0] == first[0]
    with pytest.raises(UserError, match="already there; pass --resume"):
        run_generation(opts)
    with pytest.raises(UserError, match="--resume: temperature differs"):
        run_generation(GenerateOptions(**(vars(opts) | {"resume": True, "temperature": 0.5})))


def test_greedy_batched_generation_equals_each_prompt_decoded_alone(tmp_path, tiny):
    done = run_generation(_opts(tmp_path, tiny, temperature=0.0, batch=3, workload=_workload(tmp_path) + ":all"))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(tiny).eval(), AutoTokenizer.from_pretrained(tiny)
    for g, p in zip(done, load_workload(_workload(tmp_path)).prompts):
        ids = torch.tensor([chat_ids(tok, p)])
        alone = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)[0, ids.shape[1]:]
        assert g.output_ids == alone.tolist()[:len(g.output_ids)]
        assert g.stopped in ("length", "eos", "end")


def test_a_lengthened_run_continues_each_generation_and_reads_the_shorter_run_only(tmp_path, tiny):
    short = _opts(tmp_path, tiny, new_tokens=5, min_new_tokens=5)
    first = run_generation(short)
    kept = {p: p.read_bytes() for p in sorted(short.out.rglob("*.json"))}
    longer = _opts(tmp_path, tiny, new_tokens=12, min_new_tokens=9, out=tmp_path / "long", lengthen=short.out)
    done = run_generation(longer)
    assert {p: p.read_bytes() for p in sorted(short.out.rglob("*.json"))} == kept  # the shorter run is only read
    for before, after in zip(first, done):
        assert after.prompt_ids == before.prompt_ids
        assert after.output_ids[:len(before.output_ids)] == before.output_ids  # its tokens stay those measured
        if before.stopped == "length":
            assert len(after.output_ids) == 12 or after.stopped != "length"
            assert after.seconds >= before.seconds
        else:
            assert after == before
    run = json.loads((longer.out / "run.json").read_text())["settings"]
    assert run["lengthened_from"] == {"new_tokens": 5, "min_new_tokens": 5} and run["new_tokens"] == 12
    (longer.out / "prompts" / "c.json").unlink()
    again = run_generation(GenerateOptions(**(vars(longer) | {"resume": True})))[2]
    assert again.output_ids == done[2].output_ids  # the same seed again


def test_a_greedy_run_lengthened_equals_the_longer_run(tmp_path, tiny):
    workload = _workload(tmp_path) + ":all"
    short = run_generation(_opts(tmp_path, tiny, temperature=0.0, new_tokens=4, workload=workload))
    lengthened = run_generation(_opts(tmp_path, tiny, temperature=0.0, new_tokens=12, workload=workload,
                                      out=tmp_path / "l", lengthen=tmp_path / "g"))
    whole = run_generation(_opts(tmp_path, tiny, temperature=0.0, new_tokens=12, workload=workload,
                                 out=tmp_path / "w"))
    assert any(g.stopped == "length" for g in short)  # something was continued
    assert [(g.output_ids, g.stopped) for g in lengthened] == [(g.output_ids, g.stopped) for g in whole]


@pytest.mark.parametrize(("over", "message"), [
    ({"new_tokens": 5}, "--new-tokens 5: --lengthen continues"),
    ({"min_new_tokens": 2}, "--min-new-tokens 2: .* barred the end-of-sequence token for 3"),
    ({"temperature": 0.5}, "--lengthen .*: temperature differs"),
    ({"seed": 1}, "--lengthen .*: seed differs"),
    ({"out": None}, "is --out: the run lengthened is only read"),
])
def test_lengthen_refuses_what_would_not_continue_the_same_law(tmp_path, tiny, over, message):
    short = _opts(tmp_path, tiny, new_tokens=5, min_new_tokens=3)
    run_generation(short)
    longer = {"new_tokens": 8, "min_new_tokens": 3, "out": tmp_path / "long", "lengthen": short.out}
    with pytest.raises(UserError, match=message):
        _opts(tmp_path, tiny, **(longer | {k: (short.out if v is None else v) for k, v in over.items()})).check()


def test_lengthen_refuses_a_run_missing_a_prompt(tmp_path, tiny):
    short = _opts(tmp_path, tiny, new_tokens=5)
    run_generation(short)
    (short.out / "prompts" / "b.json").unlink()
    with pytest.raises(UserError, match="b has no finished generation there; finish the run with --resume"):
        _opts(tmp_path, tiny, new_tokens=8, out=tmp_path / "long", lengthen=short.out).check()


class _Bytes:
    """Decodes each id as one character (ids 0-25 are a-z)."""

    def decode(self, ids):
        return "".join(chr(97 + i) for i in ids)


def test_an_output_is_cut_where_the_end_marker_completes_or_at_eos():
    p = Prompt("x", "p", end="zz")
    assert _cut([0, 1, 25, 25, 3, 4], p, _Bytes(), eos=None) == ([0, 1, 25, 25], "end")
    assert _cut([0, 1, 2, 7, 25, 25], p, _Bytes(), eos=7) == ([0, 1, 2, 7], "eos")
    assert _cut([0, 1, 2], p, _Bytes(), eos=7) == ([0, 1, 2], "length")
    assert _cut([0, 7, 7], Prompt("y", "p"), _Bytes(), eos=7) == ([0, 7], "eos")


def test_a_prompt_longer_than_the_context_is_refused_before_the_weights_load(tmp_path, tiny, monkeypatch):
    import calibrate.drafters.target as target

    monkeypatch.setattr(target, "load_target", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(UserError, match="prompt 'b' is .* exceed the model's context of 4096"):  # the longest prompt
        run_generation(_opts(tmp_path, tiny, new_tokens=4090))


def test_a_half_written_prompt_file_is_never_read_as_whole(tmp_path, tiny):
    opts = _opts(tmp_path, tiny, new_tokens=4)
    run_generation(opts)
    (opts.out / "prompts" / "a.json").write_text('{"id": "a", "prompt_ids": [1')
    with pytest.raises(UserError, match="a.json: not a finished generation"):
        read_generations(opts.out)


def test_the_tokenizer_identity_changes_with_the_vocabulary(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    before = tokenizer_identity(tok)
    tok.add_tokens(["<new>"])
    assert tokenizer_identity(tok) != before


def test_min_new_tokens_bars_the_end_of_sequence_token_until_then(tmp_path, tiny, monkeypatch):
    """The token greedy decoding writes first is made the end-of-sequence token: without the option every
    output ends at once; with it, every output runs to --new-tokens and holds that token nowhere before."""
    workload = _workload(tmp_path) + ":all"
    first = run_generation(_opts(tmp_path, tiny, temperature=0.0, batch=3, workload=workload, new_tokens=1))
    eos = first[0].output_ids[0]
    monkeypatch.setattr("calibrate.drafters.target.eos_token_id", lambda tok: eos)
    ended = run_generation(_opts(tmp_path, tiny, temperature=0.0, batch=3, workload=workload, out=tmp_path / "e"))
    assert ended[0].output_ids == [eos] and ended[0].stopped == "eos"
    held = run_generation(_opts(tmp_path, tiny, temperature=0.0, batch=3, workload=workload, out=tmp_path / "m",
                                min_new_tokens=12))
    for g in held:
        assert len(g.output_ids) == 12 and eos not in g.output_ids and g.stopped == "length"
