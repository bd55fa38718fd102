"""Corpus sources, the documented pydoc split, and packing into fixed-length sequences."""

from __future__ import annotations

import json

import pytest

from calibrate.corpus import documents, pack, pydoc_topics, stdlib_modules
from calibrate.errors import UserError


def _chars(text: str) -> list[int]:
    return [ord(c) % 251 for c in text]


def test_pydoc_split_is_deterministic_disjoint_and_every_tenth_topic_held_out():
    everything = pydoc_topics("all")
    names = [name for name, _ in everything]
    assert names == sorted(names)
    train = [n for n, _ in pydoc_topics("train")]
    held = [n for n, _ in pydoc_topics("heldout")]
    assert held == names[9::10]
    assert not set(train) & set(held)
    assert sorted(train + held) == names
    assert pydoc_topics() == pydoc_topics("train")


def test_pydoc_sources():
    assert list(documents("pydoc")) == [t for _, t in pydoc_topics("train")]
    assert list(documents("pydoc:heldout")) == [t for _, t in pydoc_topics("heldout")]
    with pytest.raises(UserError, match="unknown split"):
        list(documents("pydoc:dev"))


def test_txt_jsonl_and_folder(tmp_path):
    (tmp_path / "b.txt").write_text("second file", encoding="utf-8")
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two", "id": 3}) + "\n",
                                      encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("third", encoding="utf-8")
    (tmp_path / "ignored.csv").write_text("x", encoding="utf-8")
    assert list(documents(str(tmp_path / "b.txt"))) == ["second file"]
    assert list(documents(str(tmp_path / "a.jsonl"))) == ["one", "two"]
    assert list(documents(str(tmp_path))) == ["one", "two", "second file", "third"]


@pytest.mark.parametrize("content,match", [
    ('{"text": "ok"}\nnot json\n', "line 2 is not JSON"),
    ('{"body": "x"}\n', "line 1 has no string 'text' field"),
    ('["text"]\n', "line 1 has no string 'text' field"),
])
def test_bad_jsonl_lines_are_named(tmp_path, content, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(UserError, match=match):
        list(documents(str(path)))


def test_bad_paths(tmp_path):
    with pytest.raises(UserError, match="no such file or folder"):
        list(documents(str(tmp_path / "missing.txt")))
    (tmp_path / "data.csv").write_text("a,b", encoding="utf-8")
    with pytest.raises(UserError, match="expected a .txt or .jsonl file"):
        list(documents(str(tmp_path / "data.csv")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no .txt or .jsonl files"):
        list(documents(str(tmp_path / "empty")))


def test_pack_cuts_exact_sequences_with_separators(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in ["abcde", "fgh", "ijklmnop"]), encoding="utf-8")
    seqs = list(pack(str(path), _chars, 0, 4))
    flat = _chars("abcde") + [0] + _chars("fgh") + [0] + _chars("ijklmnop")
    assert seqs == [flat[i:i + 4] for i in range(0, len(flat) - 3, 4)]
    assert all(len(s) == 4 for s in seqs)
    assert list(pack(str(path), _chars, 0, 4, limit=2)) == seqs[:2]
    assert list(pack(str(path), _chars, 0, 4)) == seqs  # deterministic


def test_pack_joins_with_a_blank_line_only_without_eos(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in ["abcde", "fgh"]), encoding="utf-8")
    assert list(pack(str(path), _chars, None, 10)) == [_chars("abcde\n\nfgh")]
    assert list(pack(str(path), _chars, 7, 9)) == [_chars("abcde") + [7] + _chars("fgh")]


def test_pack_reads_lazily():
    read = []

    def tokenize(text):
        read.append(text)
        return _chars(text)

    first = next(iter(pack("pydoc", tokenize, 0, 64, limit=1)))
    assert len(first) == 64 and len(read) < 5


def test_empty_or_short_corpus_is_a_user_error(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n", encoding="utf-8")
    with pytest.raises(UserError, match="holds no text"):
        list(pack(str(empty), _chars, 0, 8))
    short = tmp_path / "short.txt"
    short.write_text("abc", encoding="utf-8")
    with pytest.raises(UserError, match="its 3 tokens do not fill one sequence of --max-length 8"):
        list(pack(str(short), _chars, 0, 8))


def _fake_stdlib(root):
    for name in ("a.py", "b.py", "json/__init__.py", "json/decoder.py", "test/test_a.py", "unittest/test/t.py",
                 "idlelib/idle_test/x.py", "lib2to3/tests/y.py", "site-packages/pkg/z.py", "notes.txt",
                 *(f"m{i:02d}.py" for i in range(20))):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {name}\n", encoding="utf-8")
    (root / "latin.py").write_bytes("# -*- coding: latin-1 -*-\nname = 'caf\xe9'\n".encode("latin-1"))


def test_stdlib_split_is_deterministic_disjoint_and_leaves_tests_out(tmp_path):
    _fake_stdlib(tmp_path)
    everything = stdlib_modules("all", tmp_path)
    names = [name for name, _ in everything]
    assert names == sorted(names) and len(names) == 25  # 2 + 2 + 20 + latin.py
    assert not any(part in ("test", "tests", "idle_test", "site-packages") for n in names for part in n.split("/"))
    train, held = (stdlib_modules(split, tmp_path) for split in ("train", "heldout"))
    assert [n for n, _ in held] == names[9::10]
    assert not {n for n, _ in train} & {n for n, _ in held}
    assert sorted(train + held) == everything
    assert stdlib_modules("heldout", tmp_path) == held  # deterministic


def test_stdlib_corpus_reads_the_real_standard_library():
    train, held = stdlib_modules("train"), stdlib_modules("heldout")
    assert len(held) >= 50 and len(train) >= 9 * len(held) - 9
    assert not {n for n, _ in train} & {n for n, _ in held}
    assert any(n == "json/decoder.py" for n, _ in train + held)
    first = next(documents("stdlib:heldout"))
    assert first == held[0][1].read_text(encoding="utf-8")
    with pytest.raises(UserError, match="--corpus stdlib:dev: unknown split"):
        list(documents("stdlib:dev"))


def test_stdlib_files_are_read_in_their_declared_encoding(tmp_path):
    from calibrate.corpus import _source_text

    _fake_stdlib(tmp_path)
    assert "café" in _source_text(tmp_path / "latin.py")
