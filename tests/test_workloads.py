"""Workload files: the built-in prompts' shape, and every bad line refused in one line naming it."""

from __future__ import annotations

import json
import re

import pytest

from calibrate.errors import UserError
from calibrate.workloads import BUILTIN, Prompt, Workload, builtin_path, chat_ids, check_fits, load_workload


@pytest.mark.parametrize("name", BUILTIN)
def test_builtin_workloads_have_twelve_train_and_four_heldout_prompts(name):
    train, held = load_workload(name), load_workload(f"{name}:heldout")
    assert len(train.prompts) == 12 and len(held.prompts) == 4
    every = load_workload(f"{name}:all")
    assert [p.id for p in every.prompts] == [p.id for p in train.prompts + held.prompts]
    assert len({p.prompt for p in every.prompts}) == 16  # no prompt repeated


def test_diary_prompts_ask_for_the_longgenbench_shape():
    for p in load_workload("diary:all").prompts:
        assert p.end == "*** finished ***" and p.end in p.prompt
        assert "#*# Week N (start date - end date):" in p.prompt and "52 entries" in p.prompt
        assert len(re.findall(r"birthday is on", p.prompt)) == 5
        weeks = re.search(r"during weeks (\d+) and (\d+)", p.prompt)
        assert weeks and int(weeks[2]) == int(weeks[1]) + 1
        every = re.search(r"Starting in week (\d+), you spend one day every (\d+) weeks", p.prompt)
        assert every and 10 <= int(every[1]) <= 19 and 3 <= int(every[2]) <= 5


def test_math_and_science_prompts_carry_their_answer_format():
    for p in load_workload("math:all").prompts:
        assert p.prompt.endswith("put your final answer within \\boxed{}.") and p.answer.isdigit()
    for p in load_workload("science:all").prompts:
        assert "'Answer: LETTER'" in p.prompt and p.answer in "ABCD"
        assert all(f"\n{letter}) " in p.prompt for letter in "ABCD")


def _write(tmp_path, *records) -> str:
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return str(path)


def test_a_users_file_and_its_splits(tmp_path):
    path = _write(tmp_path, {"id": "a", "prompt": "Write a story."}, "",
                  {"id": "b", "prompt": "Write a poem.", "split": "heldout", "end": "THE END"})
    w = load_workload(path)
    assert w.name == "mine" and w.split == "train" and w.prompts == (Prompt("a", "Write a story."),)
    assert load_workload(path + ":heldout").prompts[0].end == "THE END"
    assert len(load_workload(path, default_split="all").prompts) == 2
    assert w.to_dict()["ids"] == ["a"]


BAD = [
    ("missing-prompt", [{"id": "a"}], "line 1: missing field 'prompt'"),
    ("missing-id", [{"prompt": "x"}], "line 1: missing field 'id'"),
    ("empty-prompt", [{"id": "a", "prompt": "  "}], "field 'prompt' is \"  \""),
    ("number-id", [{"id": 3, "prompt": "x"}], "field 'id' is 3"),
    ("empty-end", [{"id": "a", "prompt": "x", "end": ""}], "field 'end'"),
    ("bad-split", [{"id": "a", "prompt": "x", "split": "test"}], "split 'test'"),
    ("unknown-field", [{"id": "a", "prompt": "x", "temperature": 1}], "unknown field 'temperature'"),
    ("duplicate-id", [{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}], "line 2: id 'a' appears twice"),
    ("not-json", ['{"id": "a", '], "line 1: not valid JSON"),
    ("not-object", ['["a", "b"]'], "expected a JSON object"),
    ("no-prompts", [""], "no prompts in it"),
    ("empty-split", [{"id": "a", "prompt": "x"}], "none of its 1 prompts is in the heldout split"),
]


@pytest.mark.parametrize("records,fragment", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_workload_lines_are_refused_naming_the_line(tmp_path, records, fragment):
    path = _write(tmp_path, *records)
    source = path + (":heldout" if "heldout" in fragment else "")
    with pytest.raises(UserError, match=re.escape(fragment)) as err:
        load_workload(source)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("source,fragment", [
    ("poetry", "not a built-in workload"),
    ("prompts.txt", "not a built-in workload"),
    ("missing.jsonl", "no such file"),
    (":heldout", "expected one of diary, math, science"),
])
def test_bad_workload_names_are_refused(tmp_path, monkeypatch, source, fragment):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=fragment):
        load_workload(source)


class _Tokenizer:
    """Whitespace tokens; a chat template that wraps the message in two marker tokens."""

    chat_template = "two markers"

    def apply_chat_template(self, messages, add_generation_prompt):
        assert add_generation_prompt and messages[0]["role"] == "user"
        return {"input_ids": [1] + [7] * len(messages[0]["content"].split()) + [2]}


def test_chat_template_is_applied_and_a_prompt_longer_than_the_context_is_refused():
    tok = _Tokenizer()
    prompt = Prompt("p1", "one two three")
    assert chat_ids(tok, prompt) == [1, 7, 7, 7, 2]
    workload = Workload("w", builtin_path("math"), "train", (prompt,))
    check_fits(workload, tok, context=10, new_tokens=5)  # 5 + 5 fits exactly
    with pytest.raises(UserError, match="prompt 'p1' is 5 tokens.*ask for at most 5 new tokens"):
        check_fits(workload, tok, context=10, new_tokens=6)
    with pytest.raises(UserError, match="shorten the prompt"):
        check_fits(workload, tok, context=4, new_tokens=1)


def test_the_advised_number_of_new_tokens_fits_every_prompt():
    """Where several prompts are too long, the refusal names the longest, so its advice fits them all."""
    tok = _Tokenizer()
    prompts = (Prompt("short", "one"), Prompt("long", "one two three four"), Prompt("mid", "one two"))
    workload = Workload("w", builtin_path("math"), "train", prompts)
    with pytest.raises(UserError, match="prompt 'long' is 6 tokens.*ask for at most 4 new tokens"):
        check_fits(workload, tok, context=10, new_tokens=9)
    check_fits(workload, tok, context=10, new_tokens=4)
