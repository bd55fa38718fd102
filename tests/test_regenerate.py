"""``scripts/regenerate.py``: training text sampled from the target, checked against the target's law.

A tiny random Llama stands in for SmolLM2 (``--base``, with ``--prompts``). The continuation runs over
the model's KV cache one token a forward; the references here recompute every step with a whole
forward over the text so far, in float64, where the cache and the whole forward agree to ~1e-15,
far below any gap between two tokens' logits, so the token ids must be equal, not close.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from calibrate.training import regenerate

from tiny_checkpoints import tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)


@pytest.fixture
def base(tmp_path):
    tiny_target(num_layers=2, vocab_size=64).save_pretrained(tmp_path / "base")
    np.save(tmp_path / "prompts.npy", np.random.default_rng(0).integers(1, 60, (5, 12)))
    return tmp_path


def _model():
    return tiny_target(num_layers=2, vocab_size=64).double()


def _reference(model, prompts, new, temperature, ban, generator):
    """The same draws without a cache: a whole forward over the text so far at every step."""
    text = prompts
    for _ in range(new):
        logits = model(input_ids=text).logits[:, -1].float()
        logits[:, ban] = -math.inf
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            nxt = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator)
        text = torch.cat((text, nxt), dim=1)
    return text


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_the_cached_continuation_draws_what_the_whole_forward_law_gives(temperature):
    model = _model()
    prompts = torch.randint(1, 60, (3, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = regenerate.continue_text(model, prompts, 9, temperature, [], torch.Generator().manual_seed(5))
        want = _reference(model, prompts, 9, temperature, [], torch.Generator().manual_seed(5))
    assert got.shape == (3, 16) and torch.equal(got[:, :7], prompts)
    assert torch.equal(got, want)


def test_a_banned_token_is_never_drawn_even_where_it_is_the_models_choice():
    model = _model()
    prompts = torch.randint(1, 60, (4, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        free = regenerate.continue_text(model, prompts, 12, 0.0, [], None)
        ban = sorted({int(t) for t in free[:, 6:].flatten()})[:3]  # tokens greedy decoding does pick
        banned = regenerate.continue_text(model, prompts, 12, 0.0, ban, None)
        want = _reference(model, prompts, 12, 0.0, ban, None)
    assert not any(int(t) in ban for t in banned[:, 6:].flatten())
    assert torch.equal(banned, want)  # the argmax among the tokens left
    sampled = regenerate.continue_text(model, prompts, 40, 5.0, ban, torch.Generator().manual_seed(3))
    assert not any(int(t) in ban for t in sampled[:, 6:].flatten())  # a flat law at T = 5 would draw them


def _argv(tmp, out, *extra):
    return ["--base", str(tmp / "base"), "--prompts", str(tmp / "prompts.npy"), "--out", str(tmp / out),
            "--sequences", "5", "--seq-len", "20", "--prompt", "8", "--batch", "2", "--ban", "3,4", *extra]


def test_a_run_writes_the_file_and_a_stopped_run_resumes_to_the_same_file(base, monkeypatch):
    regenerate.main(_argv(base, "new/folder/whole.npy"))  # --out's folder made
    whole = np.load(base / "new/folder/whole.npy")
    prompts = np.load(base / "prompts.npy")
    assert whole.shape == (5, 20) and np.array_equal(whole[:, :8], prompts[:, :8])
    assert not np.isin(whole[:, 8:], [3, 4]).any()
    assert not (base / "new/folder/whole.npy.partial").exists()

    calls = {"n": 0}
    real = regenerate.continue_text

    def stop_after_one(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # the run stopped during its second batch
        return real(*args, **kwargs)

    monkeypatch.setattr(regenerate, "continue_text", stop_after_one)
    with pytest.raises(KeyboardInterrupt):
        regenerate.main(_argv(base, "again.npy"))
    assert not (base / "again.npy").exists() and len(list((base / "again.npy.partial").glob("batch-*.npy"))) == 1
    monkeypatch.setattr(regenerate, "continue_text", real)
    regenerate.main(_argv(base, "again.npy"))
    assert np.array_equal(np.load(base / "again.npy"), whole)  # each batch drawn from its own seed
    regenerate.main(_argv(base, "other.npy", "--seed", "1"))
    assert not np.array_equal(np.load(base / "other.npy")[:, 8:], whole[:, 8:])


def test_a_partial_run_with_other_options_is_refused(base):
    (base / "x.npy.partial").mkdir()
    (base / "x.npy.partial" / "run.json").write_text('{"seed": "9"}')
    with pytest.raises(SystemExit, match="holds a run with other options"):
        regenerate.main(_argv(base, "x.npy"))
    (base / "x.npy.partial" / "run.json").write_text("[not json")
    with pytest.raises(SystemExit, match="holds a run with other options"):
        regenerate.main(_argv(base, "x.npy"))


@pytest.mark.parametrize("args, named", [
    (["--prompt", "20"], "--prompt 20: give fewer tokens than --seq-len 20"),
    (["--temperature", "-1"], "--temperature -1.0: give a finite temperature >= 0"),
    (["--temperature", "nan"], "--temperature nan"),
    (["--ban", "x"], "--ban 'x': give token ids"),
    (["--ban", "-2"], "--ban -2: token ids are >= 0"),
    (["--ban", "64"], "--ban 64: the model has 64 tokens"),
    (["--sequences", "0"], "--sequences 0: give an integer >= 1"),
    (["--batch", "0"], "--batch 0: give an integer >= 1"),
    (["--seed", "-1"], "--seed -1: give an integer from 0 to 4294967295"),
    (["--seed", str(2 ** 70)], f"--seed {2 ** 70}: give an integer"),
])
def test_bad_options_are_refused_in_one_line(base, args, named):
    with pytest.raises(SystemExit, match=named.replace("(", r"\(").replace("[", r"\[")):
        regenerate.main(_argv(base, "bad.npy", *args))
    assert not (base / "bad.npy").exists()


def test_files_and_folders_that_do_not_fit_are_refused(base):
    (base / "there.npy").write_bytes(b"keep")
    np.save(base / "short.npy", np.ones((3, 4), dtype=np.int64))
    np.save(base / "floats.npy", np.ones((3, 12)))
    (base / "garbage.npy").write_bytes(b"not an array")
    cases = [
        (["--out", str(base / "there.npy")], "exists; give a new file"),
        (["--out", str(base / "t.txt")], "give a .npy file name"),
        (["--base", str(base / "nothing")], "no config.json there"),
        (["--prompts", str(base / "none.npy")], "no such file"),
        (["--prompts", str(base / "short.npy")], r"shape \(3, 4\)"),
        (["--prompts", str(base / "floats.npy")], "float64; expected integers"),
        (["--prompts", str(base / "garbage.npy")], "not a .npy array"),
        (["--out", str(base / "there.npy" / "x.npy")], "there.npy is a file; give a path in a folder"),
    ]
    for extra, named in cases:
        with pytest.raises(SystemExit, match=named):
            regenerate.main(_argv(base, "out.npy") + extra)
    assert (base / "there.npy").read_bytes() == b"keep"
    with pytest.raises(SystemExit, match="give --prompts too"):
        regenerate.main(["--base", str(base / "base"), "--out", str(base / "o.npy")])
    with pytest.raises(SystemExit, match="--sources pydoc:test: train only on the train split"):
        regenerate.main(["--sources", "pydoc:test", "--out", str(base / "o.npy")])
    with pytest.raises(SystemExit, match="--sources nowhere.txt: no such file or folder"):
        regenerate.main(["--sources", "nowhere.txt", "--out", str(base / "o.npy")])
    with pytest.raises(SystemExit, match="--ban 49152: SmolLM2 has 49152 tokens"):
        regenerate.main(["--ban", "49152", "--out", str(base / "o.npy")])


def test_more_sequences_than_prompts_take_the_prompts_again_each_its_own_draw(base):
    argv = _argv(base, "more.npy")
    argv[argv.index("--sequences") + 1] = "7"
    regenerate.main([*argv, "--batch", "100"])  # a batch larger than the run holds the run
    more = np.load(base / "more.npy")
    prompts = np.load(base / "prompts.npy")
    assert more.shape == (7, 20)
    assert np.array_equal(more[:, :8], prompts[np.arange(7) % 5, :8])
    assert not np.array_equal(more[5, 8:], more[0, 8:])  # the same prompt, another continuation
