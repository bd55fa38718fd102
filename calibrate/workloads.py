"""Long-generation workloads: prompts the target answers at length, the paper's setting.

A workload is a JSONL file, one prompt a line (a JSON object):

``id`` (required)
    a non-empty string, unique in the file; names the prompt in every report.
``prompt`` (required)
    the user's message, a non-blank string; the target's chat template is applied to it
    (:func:`chat_ids`), so it is written as a person would type it.
``split`` (optional, ``train`` or ``heldout``; default ``train``)
    which side of the split the prompt is on: calibration reads ``train`` prompts, checks read
    ``heldout`` ones, so a spec is never judged on the text it was fitted to.
``end`` (optional)
    a marker whose appearance in the generated text ends the generation (besides the target's
    end-of-sequence token), e.g. the diary's ``*** finished ***``.
``answer`` (optional)
    the expected final answer (math: the boxed value; science: the letter), kept for reports.

No other field is accepted, so a misspelt one is found at once rather than silently ignored.

Built-in workloads (``--workload NAME``; ``NAME:heldout`` / ``NAME:all`` for the other splits), written
for this project in the shapes the long-generation literature uses (no benchmark's text is copied),
16 prompts each, the last 4 held out:

``diary``
    LongGenBench's shape: a named person and occupation, dated facts the entries must honour
    (five family birthdays, an event over two consecutive weeks, a task every 3-5 weeks from a
    week between 10 and 19), 52 weekly entries under ``#*# Week N (dates):`` headers of at least
    200 words each, then ``*** finished ***``.
``math``
    competition problems (integer answers), each followed by "Please reason step by step, and
    put your final answer within \\boxed{}." (the suffix the DFlash benchmark uses).
``science``
    graduate-level multiple choice (four options), reasoning first, then a last line
    ``Answer: LETTER``.

A user's own file is named by its path (``--workload prompts.jsonl``, ``prompts.jsonl:heldout``).
Every check here runs before any model loads, except :func:`check_fits`, which needs the target's
tokenizer only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError

__all__ = ["BUILTIN", "SPLITS", "Prompt", "Workload", "builtin_path", "chat_ids", "check_fits", "load_workload",
           "parse_workload"]

BUILTIN = ("diary", "math", "science")
SPLITS = ("train", "heldout", "all")
FIELDS = ("id", "prompt", "split", "end", "answer")
REQUIRED = ("id", "prompt")


@dataclass(frozen=True)
class Prompt:
    """One prompt of a workload (the fields of its JSONL line)."""

    id: str
    prompt: str
    split: str = "train"
    end: str | None = None
    answer: str | None = None


@dataclass(frozen=True)
class Workload:
    """The prompts of one split of a workload file, in file order."""

    name: str  # the built-in name, or the file's stem
    path: Path
    split: str
    prompts: tuple[Prompt, ...]

    def to_dict(self) -> dict:
        """What a result records to name the workload (enough to tell two runs apart)."""
        return {"name": self.name, "path": str(self.path), "split": self.split, "ids": [p.id for p in self.prompts]}


def builtin_path(name: str) -> Path:
    """The packaged JSONL file of the built-in workload ``name``."""
    return Path(__file__).parent / "assets" / "workloads" / f"{name}.jsonl"


def parse_workload(source: str, default_split: str = "train") -> tuple[Path, str, str]:
    """``(path, name, split)`` of a ``--workload`` value: ``NAME``, ``NAME:SPLIT``, ``FILE.jsonl`` or ``FILE.jsonl:SPLIT``."""
    base, split = source, default_split
    head, sep, tail = source.rpartition(":")
    if sep and tail in SPLITS:
        base, split = head, tail
    if not base:
        raise UserError(f"--workload {source!r}: expected one of {', '.join(BUILTIN)} or a .jsonl file "
                        "(optionally followed by :train, :heldout or :all)")
    if base in BUILTIN:
        return builtin_path(base), base, split
    path = Path(base).expanduser()
    if path.suffix != ".jsonl":
        raise UserError(f"--workload {source}: not a built-in workload ({', '.join(BUILTIN)}) nor a .jsonl file; "
                        "name one of those")
    if not path.is_file():
        raise UserError(f"--workload {source}: no such file {path}; check the path")
    return path, path.stem, split


def load_workload(source: str, default_split: str = "train") -> Workload:
    """The prompts of ``source`` (see :func:`parse_workload`), every line checked; ``UserError`` naming the first bad one."""
    path, name, split = parse_workload(source, default_split)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"--workload {path}: cannot read it ({err.__class__.__name__}: {err}); "
                        "pass a readable UTF-8 JSONL file") from None
    prompts, seen = [], set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        prompt = _prompt(line, f"--workload {path} line {number}")
        if prompt.id in seen:
            raise UserError(f"--workload {path} line {number}: id {prompt.id!r} appears twice; give every prompt "
                            "its own id")
        seen.add(prompt.id)
        prompts.append(prompt)
    if not prompts:
        raise UserError(f"--workload {path}: no prompts in it; write one JSON object a line with id and prompt")
    chosen = tuple(p for p in prompts if split == "all" or p.split == split)
    if not chosen:
        raise UserError(f"--workload {source}: none of its {len(prompts)} prompts is in the {split} split; "
                        f"mark some with \"split\": \"{split}\" or name {name}:all")
    return Workload(name=name, path=path, split=split, prompts=chosen)


def _prompt(line: str, where: str) -> Prompt:
    """One checked line of a workload file."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(f"{where}: not valid JSON ({err.msg} at column {err.colno}); write one JSON object a line") \
            from None
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object with id and prompt, got {type(record).__name__}")
    unknown = sorted(set(record) - set(FIELDS))
    if unknown:
        raise UserError(f"{where}: unknown field {unknown[0]!r}; the fields are {', '.join(FIELDS)}")
    for field in REQUIRED:
        if field not in record:
            raise UserError(f"{where}: missing field {field!r}; every prompt needs id and prompt")
    for field in FIELDS:
        value = record.get(field)
        if field in record and not (isinstance(value, str) and value.strip()):
            raise UserError(f"{where}: field {field!r} is {json.dumps(value)[:40]}; expected a non-empty string")
    if record.get("split", "train") not in SPLITS[:2]:
        raise UserError(f"{where}: split {record['split']!r}; expected train or heldout")
    return Prompt(**record)


def chat_ids(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of ``prompt`` as the target reads it: its chat template applied, the assistant's turn opened.

    A tokenizer without a chat template reads the bare prompt (base models).
    """
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt.prompt}], add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers >= 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer(prompt.prompt, add_special_tokens=True)["input_ids"])


def check_fits(workload: Workload, tokenizer, context: int, new_tokens: int) -> None:
    """``UserError`` naming the longest prompt when its tokens plus ``new_tokens`` exceed ``context`` (the model's
    length), so the number of new tokens it advises fits every prompt."""
    if not workload.prompts:
        return
    lengths = [len(chat_ids(tokenizer, p)) for p in workload.prompts]
    length = max(lengths)
    prompt = workload.prompts[lengths.index(length)]
    if length + new_tokens > context:
        room = context - length
        advice = f"ask for at most {room} new tokens" if room > 0 else "shorten the prompt"
        raise UserError(f"--workload {workload.path}: prompt {prompt.id!r} is {length} tokens, and {length} + "
                        f"{new_tokens} new tokens exceed the model's context of {context}; {advice}")
