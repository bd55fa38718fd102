"""The target's own long text: ``sharpdraft generate`` writes what the target answers to a workload.

A run writes a folder::

    OUT/run.json           settings, the tokenizer's identity, the workload's prompt ids (written first)
    OUT/prompts/ID.json    one prompt's generation, written atomically once the prompt is done

Each prompt file holds ``id``, ``prompt_ids`` (the chat-templated prompt), ``output_ids`` (the
generated tokens, cut after the workload's end marker when it appears), ``text`` (their decoding),
``stopped`` (``eos``, ``end`` or ``length``) and ``seconds``. ``min_new_tokens`` bars the target's
end-of-sequence token until that many tokens are written (transformers' ``min_new_tokens``, vLLM's
``min_tokens``): a small target ends a math answer in a few hundred tokens, and a corpus for long
contexts needs it to keep writing; the end marker still stops a generation. A prompt file exists only when its
generation finished, so a run stopped half-way never leaves a half-written generation to be read as
whole; ``--resume`` continues a run with the same settings and skips the prompts already written.

``--lengthen RUN`` writes a longer corpus from a finished one: every generation of ``RUN`` that ran to its
``--new-tokens`` is continued, prompt and output as the prefix, to the new ``--new-tokens``; those that
ended (end-of-sequence token or end marker) are kept as they are. ``RUN`` is only read, and must have been
written with the same options but ``new_tokens`` (more now) and ``min_new_tokens`` (at least as many now),
so the longer text is a draw from the law a single run with the new options samples: sampling depends on
the text so far only, and the end-of-sequence token is barred up to the new ``min_new_tokens``. The first
tokens stay those of ``RUN``, so what was measured on them holds. A continuation batch is seeded from its
first prompt's seed with the number of tokens already written (not replaying ``RUN``'s draws); the new
``run.json`` records ``RUN``'s lengths under ``lengthened_from``.

Generation is batched (``batch`` prompts decode together, left-padded) with transformers' own
``generate`` (plain target decoding: no drafter) over a static cache, allocated once for the whole
generation: the default cache grows by concatenation, copying every layer's keys and values at each step,
which made a step at 2,048 tokens of context 2.8 times slower for a batch of 16 (0.64 s against 0.23 s, 1
thread; ``benchmarks/bench_generate.py`` measures it). Sampling (the default, temperature 0.8, nucleus
``top_p``) draws from a generator seeded by the run's seed and the batch's first prompt, so a batch
gives the same text whether a run is resumed or not (a batch's files are written together once it is
done; a prompt whose file was removed decodes in a smaller batch, from the same law but another
sample); ``temperature 0`` is greedy.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from sharpdraft_theory.atomic import atomic_write_text

from .errors import UserError
from .preflight import check_outputs, local_inputs
from .workloads import Prompt, Workload, chat_ids, check_fits, load_workload, parse_workload

__all__ = ["GenerateOptions", "Generation", "read_generations", "run_generation", "tokenizer_and_context",
           "tokenizer_identity"]

MAX_NEW_TOKENS = 1 << 17


@dataclass(frozen=True)
class GenerateOptions:
    """Everything a generation run depends on; checked once by :meth:`check` before any model loads."""

    workload: str
    out: Path
    new_tokens: int = 4096
    min_new_tokens: int = 0  # the target's end-of-sequence token is barred until this many tokens are written
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int = 0
    batch: int = 4
    prompts: int | None = None  # the first N prompts of the split (None: all)
    target_path: str | None = None
    threads: int | None = None  # CPU threads for torch (None: torch's default)
    resume: bool = False
    lengthen: Path | None = None  # a finished run whose generations this one continues (only read)

    def check(self) -> Workload:
        """The workload's prompts, after every option is checked; ``UserError`` naming the first bad one."""
        if not 1 <= self.new_tokens <= MAX_NEW_TOKENS:
            raise UserError(f"--new-tokens {self.new_tokens}: expected 1 to {MAX_NEW_TOKENS}")
        if not 0 <= self.min_new_tokens <= self.new_tokens:
            raise UserError(f"--min-new-tokens {self.min_new_tokens}: expected 0 to --new-tokens ({self.new_tokens})")
        if not (self.temperature == self.temperature and 0 <= self.temperature <= 10):  # NaN fails the first test
            raise UserError(f"--temperature {self.temperature}: expected 0 (greedy) to 10")
        if not (self.top_p == self.top_p and 0 < self.top_p <= 1):
            raise UserError(f"--top-p {self.top_p}: expected a number in (0, 1]")
        if not 0 <= self.seed < 2**63:
            raise UserError(f"--seed {self.seed}: expected 0 to 2^63 - 1")
        if not 1 <= self.batch <= 256:
            raise UserError(f"--batch {self.batch}: expected 1 to 256 prompts decoded together")
        if self.prompts is not None and self.prompts < 1:
            raise UserError(f"--prompts {self.prompts}: expected at least 1 (or leave it out for all)")
        if self.threads is not None and self.threads < 1:
            raise UserError(f"--threads {self.threads}: expected at least 1 (or leave it out for torch's default)")
        if self.out.exists() and not self.out.is_dir():
            raise UserError(f"--out {self.out}: a file is there; name a folder for the generations")
        check_outputs({"--out": self.out}, local_inputs(workload=parse_workload(self.workload)[0],
                                                        target_path=self.target_path), folders=("--out",))
        workload = load_workload(self.workload)
        if self.prompts is not None:
            workload = Workload(workload.name, workload.path, workload.split, workload.prompts[:self.prompts])
        if self.lengthen is not None:
            _check_lengthen(self, workload)
        _check_resume(self, workload)
        return workload

    def settings(self, workload: Workload) -> dict:
        """What a resumed run must match: every option but ``out`` and ``resume``, and the prompts' ids."""
        d = asdict(self)
        for name in ("out", "resume", "workload", "prompts", "threads", "lengthen"):
            d.pop(name)
        d["greedy"] = self.temperature == 0
        d["workload"] = workload.to_dict()
        if self.lengthen is not None:
            before = _recorded(self.lengthen, "--lengthen")["settings"]
            d["lengthened_from"] = {k: before.get(k) for k in ("new_tokens", "min_new_tokens")}
        return d


@dataclass(frozen=True)
class Generation:
    """One prompt's finished generation (a ``prompts/ID.json`` file)."""

    id: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    stopped: str
    seconds: float


def tokenizer_identity(tokenizer) -> str:
    """A short hash of what makes two tokenizers give the same ids: vocabulary, special tokens, chat template."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps([tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]).encode())
    h.update((getattr(tokenizer, "chat_template", None) or "").encode())
    return h.hexdigest()[:16]


def _recorded(run: Path, option: str, advice: str = "name a folder written by `sharpdraft generate`") -> dict:
    """``run``'s run.json, checked to be a dict holding settings; ``UserError`` naming ``option`` otherwise."""
    try:
        recorded = json.loads((run / "run.json").read_text())
        if not isinstance(recorded.get("settings"), dict):
            raise TypeError
    except (OSError, ValueError, AttributeError, TypeError):
        raise UserError(f"{option} {run}: its run.json cannot be read; {advice}") from None
    return recorded


def _differs(before: dict, now: dict, skip: tuple[str, ...] = ()) -> str | None:
    """The first setting (sorted by name) ``before`` and ``now`` disagree on, ``skip`` aside; None if none."""
    changed = sorted(k for k in set(before) | set(now) if k not in skip and before.get(k) != now.get(k))
    return changed[0] if changed else None


def _check_resume(opts: GenerateOptions, workload: Workload) -> None:
    run = opts.out / "run.json"
    if not run.exists():
        return
    if not opts.resume:
        raise UserError(f"--out {opts.out}: a generation run is already there; pass --resume to continue it, "
                        "or name another folder")
    before = _recorded(opts.out, "--out", "name another folder")["settings"]
    now = json.loads(json.dumps(opts.settings(workload)))
    key = _differs(before, now)
    if key is not None:
        raise UserError(f"--resume: {key} differs from the run in {opts.out} "
                        f"({before.get(key)!r} there, {now.get(key)!r} now); rerun with its options "
                        "or name another folder")


def _check_lengthen(opts: GenerateOptions, workload: Workload) -> None:
    """``--lengthen RUN``: a finished run of the same options, shorter, holding every prompt; read only."""
    run = opts.lengthen
    if not (run / "run.json").is_file():
        raise UserError(f"--lengthen {run}: not a generation run (no run.json); name a folder written by "
                        "`sharpdraft generate`")
    if run.resolve() == opts.out.resolve():
        raise UserError(f"--lengthen {run} is --out: the run lengthened is only read; name another --out")
    before = _recorded(run, "--lengthen")["settings"]
    now = json.loads(json.dumps(opts.settings(workload)))
    key = _differs(before, now, skip=("new_tokens", "min_new_tokens", "lengthened_from"))
    if key is not None:
        raise UserError(f"--lengthen {run}: {key} differs ({before.get(key)!r} there, {now.get(key)!r} now); "
                        "pass the options it was generated with")
    if not isinstance(before.get("new_tokens"), int) or not isinstance(before.get("min_new_tokens"), int):
        raise UserError(f"--lengthen {run}: its run.json records no token counts; name a folder written by "
                        "`sharpdraft generate`")
    if opts.new_tokens <= before["new_tokens"]:
        raise UserError(f"--new-tokens {opts.new_tokens}: --lengthen continues {run}'s generations past its "
                        f"{before['new_tokens']} tokens; expected more")
    if opts.min_new_tokens < before["min_new_tokens"]:
        raise UserError(f"--min-new-tokens {opts.min_new_tokens}: {run} barred the end-of-sequence token for "
                        f"{before['min_new_tokens']} tokens; expected at least that")
    written = {g.id for g in read_generations(run)}
    missing = [p.id for p in workload.prompts if p.id not in written]
    if missing:
        raise UserError(f"--lengthen {run}: {missing[0]} has no finished generation there; finish the run with "
                        "--resume first")


def run_generation(opts: GenerateOptions, *, model=None, tokenizer=None, progress=None) -> list[Generation]:
    """Generate every prompt of ``opts.workload`` not yet written; all the run's generations, in prompt order.

    ``model``/``tokenizer`` default to the target at ``opts.target_path`` (the built-in SmolLM2 when
    None). ``progress(done, total)`` is called after each batch.
    """
    import torch

    from .drafters.target import load_target

    workload = opts.check()
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    checked = False
    if model is None:
        tokenizer, context = tokenizer_and_context(opts.target_path)
        if tokenizer is not None and context:  # a prompt too long is refused before the weights load
            check_fits(workload, tokenizer, context, opts.new_tokens)
            checked = True
        model, tokenizer = load_target(opts.target_path, torch.device("cpu"), torch.float32)
    context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if context and not checked:
        check_fits(workload, tokenizer, context, opts.new_tokens)
    identity = tokenizer_identity(tokenizer)
    (opts.out / "prompts").mkdir(parents=True, exist_ok=True)
    run = opts.out / "run.json"
    if not run.exists():
        atomic_write_text(run, json.dumps({"settings": opts.settings(workload), "tokenizer": identity}, indent=1))
    elif json.loads(run.read_text()).get("tokenizer") != identity:
        raise UserError(f"--resume: the target's tokenizer is not the one {opts.out} was generated with; "
                        "rerun with the same --target-path or name another folder")
    earlier = {}
    if opts.lengthen is not None:
        if _recorded(opts.lengthen, "--lengthen").get("tokenizer") != identity:
            raise UserError(f"--lengthen {opts.lengthen}: generated with another tokenizer than the target's; "
                            "pass the --target-path it was generated with")
        earlier = {g.id: g for g in read_generations(opts.lengthen)}
    todo = [(i, p) for i, p in enumerate(workload.prompts) if not _file(opts.out, p).exists()]
    done = len(workload.prompts) - len(todo)
    batches = {}
    for i, p in todo:  # batches fixed by prompt order, so a resumed run decodes the same batches
        batches.setdefault(i // opts.batch, []).append(p)
    for first, prompts in batches.items():
        seed = opts.seed + first * opts.batch
        if not earlier:
            finished = _generate(model, tokenizer, prompts, opts, seed)
        else:  # kept as they ended, or continued in groups of as many tokens written
            finished = [earlier[p.id] for p in prompts if earlier[p.id].stopped != "length"]
            going = {}
            for p in prompts:
                if earlier[p.id].stopped == "length":
                    going.setdefault(len(earlier[p.id].output_ids), []).append(p)
            for had, group in going.items():
                finished += _generate(model, tokenizer, group, opts, seed ^ (had << 40), [earlier[p.id] for p in group])
        for g in finished:
            atomic_write_text(_file(opts.out, Prompt(g.id, "x")), json.dumps(asdict(g)))
        done += len(prompts)
        if progress is not None:
            progress(done, len(workload.prompts))
    return read_generations(opts.out)


def tokenizer_and_context(target_path: str | None):
    """``(tokenizer, context length)`` of the target read without its weights; ``(None, None)`` where that
    needs the weights (the built-in target before its converted copy is cached)."""
    from .drafters.target import load_tokenizer
    from .smollm2 import smollm2_cache_dir

    folder = Path(target_path).expanduser() if target_path is not None else smollm2_cache_dir()
    if folder is None or not (folder / "config.json").is_file():
        return None, None
    try:
        context = json.loads((folder / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None, None  # the loader names what is wrong with the folder
    return load_tokenizer(str(folder), option="--target-path"), context if isinstance(context, int) else None


def _file(out: Path, prompt: Prompt) -> Path:
    return out / "prompts" / f"{prompt.id}.json"


def _generate(model, tokenizer, prompts: list[Prompt], opts: GenerateOptions, seed: int,
              written: list[Generation] | None = None) -> list[Generation]:
    """One batch, left-padded; each output cut at its end-of-sequence token or end marker.

    ``written``: the batch's earlier generations (``--lengthen``), each as long, continued after its prompt and
    output as they were written.
    """
    import torch

    from .drafters.target import eos_token_id

    ids = [g.prompt_ids for g in written] if written else [chat_ids(tokenizer, p) for p in prompts]
    before = [g.output_ids for g in written] if written else [[] for _ in prompts]
    width = max(len(x) + len(b) for x, b in zip(ids, before))
    eos = eos_token_id(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    input_ids = torch.tensor([[pad] * (width - len(x) - len(b)) + x + b for x, b in zip(ids, before)])
    mask = torch.tensor([[0] * (width - len(x) - len(b)) + [1] * (len(x) + len(b)) for x, b in zip(ids, before)])
    sample = opts.temperature > 0
    extra = {"temperature": opts.temperature, "top_p": opts.top_p, "top_k": 0} if sample else {}
    ends = sorted({p.end for p in prompts if p.end})
    if ends:
        extra.update(stop_strings=ends, tokenizer=tokenizer)
    had = len(before[0])
    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=opts.new_tokens - had,
                             min_new_tokens=max(0, opts.min_new_tokens - had), do_sample=sample, pad_token_id=pad,
                             eos_token_id=eos, num_beams=1, cache_implementation="static", **extra)
    seconds = (time.perf_counter() - start) / len(prompts)
    result = []
    for row, (p, x) in enumerate(zip(prompts, ids)):
        output, stopped = _cut(before[row] + out[row, width:].tolist(), p, tokenizer, eos)
        spent = seconds + (written[row].seconds if written else 0.0)
        result.append(Generation(p.id, x, output, tokenizer.decode(output), stopped, round(spent, 3)))
    return result


def _cut(output: list[int], prompt: Prompt, tokenizer, eos: int | None) -> tuple[list[int], str]:
    """``output`` up to and including its end-of-sequence token or the token that completes the end marker.

    Whichever comes first; what follows it in a batch is padding. The marker is found by bisection on
    prefixes (a prefix's text holds it from some length on), so a long output is decoded about log2(n) times.
    """
    stop = output.index(eos) + 1 if eos is not None and eos in output else None
    searched = output[:stop]
    if prompt.end and prompt.end in tokenizer.decode(searched):
        lo, hi = 1, len(searched)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if prompt.end in tokenizer.decode(searched[:mid]) else (mid + 1, hi)
        return searched[:lo], "end"
    if stop is not None:
        return searched, "eos"
    return output, "length"


def read_generations(out: Path) -> list[Generation]:
    """The finished generations in ``out``, in the order of the run's prompts; ``UserError`` on a bad file."""
    try:
        ids = json.loads((out / "run.json").read_text())["settings"]["workload"]["ids"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{out}: not a generation run (no readable run.json); run `sharpdraft generate` first") \
            from None
    result = []
    for i in ids:
        path = out / "prompts" / f"{i}.json"
        if path.exists():
            try:
                result.append(Generation(**json.loads(path.read_text())))
            except (ValueError, TypeError):
                raise UserError(f"{path}: not a finished generation; delete it and rerun with --resume") from None
    return result

