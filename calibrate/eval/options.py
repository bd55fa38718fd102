"""``EvalOptions``: everything ``sharpdraft eval`` takes, checked once, before any model loads.

``EvalOptions(...)`` refuses a bad value with a one-line ``UserError`` naming the option (the
command's and the library's one check of it); :meth:`EvalOptions.from_cli` reads the command's
text values (``--lengths 256,512``, ``--variants none,spec``, ``--slopes``, ``--spec`` and
``--extra-spec`` files) into one. :meth:`EvalOptions.to_dict` is the run's key for ``--resume``.
What only the loaded drafter tells (its n_ref, block size, layers and heads) is checked by
``calibrate.eval.run.evaluate``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from sharpdraft_theory import ScaleSpec

from ..drafters import default_drafter_path, drafter_kind
from ..errors import UserError
from ..generated import is_generated
from ..lookup import MAX_NGRAM, LookupSettings
from ..measure import parse_grid, scale_grid
from ..online import OnlineOptions, online_options
from ..preflight import check_corpus, check_outputs, load_spec, local_inputs
from .variants import (DEFAULT_SINKS, DEFAULT_VARIANTS, EXTRA_NAME, EXTRA_PREFIX, LOOKUP_VARIANTS, at_top_k,
                       bucket_edges, check_variants, parse_extra_specs, with_lookup)

__all__ = ["EvalOptions", "check_temperature", "check_seed", "check_lookup", "MIN_TEMPERATURE", "MAX_TEMPERATURE",
           "MAX_SEED", "DEFAULT_BIN_SIZE"]

MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 100.0  # below, softmax(logits / T) is greedy in float32; above, all but uniform
DEFAULT_BIN_SIZE = 512  # a generated corpus's output tokens per bin (bench's default too)
MAX_SEED = 2**63 - 1  # seeds are numpy SeedSequence entropy; a bound keeps a typo from passing as a seed


def _lengths(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--lengths {text}: expected comma-separated integers, e.g. 256,512,1024,2048") from None
    if not values or min(values) < 2:
        raise UserError(f"--lengths {text}: expected context lengths >= 2, e.g. 256,512,1024,2048")
    return values


def _variants(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def check_temperature(value: float) -> float:
    """``--temperature``: finite, from :data:`MIN_TEMPERATURE` to :data:`MAX_TEMPERATURE`; else a ``UserError``."""
    if not (math.isfinite(value) and MIN_TEMPERATURE <= value <= MAX_TEMPERATURE):
        raise UserError(f"--temperature {value}: expected a temperature from {MIN_TEMPERATURE:g} to "
                        f"{MAX_TEMPERATURE:g} (default 1.0, the model's own distribution; greedy agreement is "
                        "reported besides)")
    return float(value)


def check_seed(value: int) -> int:
    """``--seed``: an integer from 0 to :data:`MAX_SEED`; else a ``UserError``."""
    if not 0 <= value <= MAX_SEED:
        raise UserError(f"--seed {value}: expected an integer from 0 to {MAX_SEED}")
    return int(value)


def check_lookup(max_ngram: int, min_ngram: int):
    """``--lookup-max-ngram`` and ``--lookup-min-ngram`` as ``calibrate.lookup.LookupSettings``; else a ``UserError``."""
    for option, value in (("--lookup-max-ngram", max_ngram), ("--lookup-min-ngram", min_ngram)):
        if not 1 <= value <= MAX_NGRAM:
            raise UserError(f"{option} {value}: expected an n-gram length from 1 to {MAX_NGRAM}")
    if min_ngram > max_ngram:
        raise UserError(f"--lookup-min-ngram {min_ngram}: must be at most --lookup-max-ngram {max_ngram}")
    return LookupSettings(max_ngram=max_ngram, min_ngram=min_ngram)


@dataclass(frozen=True)
class EvalOptions:
    """Everything ``sharpdraft eval`` takes (the CLI's options, same names), checked on creation.

    The spec files come read: ``spec`` (None: ``calibrate.eval.variants.default_spec`` at the
    drafter's n_ref) and ``extra_specs`` (``{"spec:NAME": spec}``), each at the run's ``top_k``,
    with the files they came from for the result. Once checked, ``lengths`` is sorted and
    distinct, ``variants`` starts with ``none`` (every delta is against it) and holds
    ``reference`` when a reference head is given, ``top_k`` and ``seed`` are settled, and
    ``online`` and ``lookup`` hold the online arms' and the lookup variants' settings.
    """

    drafter: str = "eagle3"  # a kind of calibrate.drafters.KINDS that evaluates
    drafter_path: str | None = None  # checkpoint, or a folder with a copy_pointer.json naming one; None: built-in
    target_path: str | None = None  # target model folder; None: built-in SmolLM2
    pointer_unmatched: str | None = None  # the copy pointer's rows matching nothing: scored or masked; None: its file's
    spec: ScaleSpec | None = None  # the spec under test, read; None: log-linear, slope 0.2, at the drafter's n_ref
    spec_file: Path | None = None  # where spec was read (--spec)
    extra_specs: Mapping[str, ScaleSpec] = field(default_factory=dict)  # {"spec:NAME": spec} on the same passes
    extra_spec_files: Mapping[str, str] = field(default_factory=dict)  # {"spec:NAME": FILE} (--extra-spec)
    lengths: tuple[int, ...] = (256, 512, 1024, 2048)  # bucket edges; the largest is the sequence length
    corpus: str = "pydoc:heldout"  # held-out text (calibrate.corpus source), recall:SOURCE for copy agreement,
    # generated:NAME[:SPLIT] for the target's own text (calibrate.generated), reported by output position too
    sequences: int | None = None  # at most this many sequences of the largest length; None: all
    skip: int = 0  # sequences of the corpus to pass over first
    bin_size: int | None = None  # a generated corpus's output tokens per bin; None: DEFAULT_BIN_SIZE on one
    top_k: int | None = None  # top set size of the mass; None: the spec's (4 without one)
    speculative: bool = False  # also run speculative decoding
    sample: bool = False  # speculative sampling at temperature instead of greedy decoding
    seed: int | None = None  # the draws' seed with sample; None: 0
    new_tokens: int = 32  # tokens generated per speculative prompt
    num_draft: int | None = None  # drafts per verification; None: 4 for chains, block size - 1 for blocks
    variants: tuple[str, ...] = DEFAULT_VARIANTS  # calibrate.eval.variants.VARIANTS to compare
    lookup_max_ngram: int = 2  # the lookup variants' longest suffix matched
    lookup_min_ngram: int = 1  # their shortest
    window: int | None = None  # the window variant's W; None: n_ref
    sinks: int = DEFAULT_SINKS  # the sinks variant's S
    neighbour_window: int | None = None  # W of the clamp and group variants; None: from n_ref
    group: int | None = None  # G of the group variants; None: from n_ref and the longest length
    n_ref: int | None = None  # the drafter's training length; None: the drafter's own
    reference_drafter_path: str | None = None  # another head of the same kind, run unscaled as reference
    temperature: float = 1.0  # T of the expected acceptance, and of the draws with sample
    slopes: tuple[float, ...] = ()  # the oracle's log-linear slopes
    alphas: tuple[float, ...] = ()  # the oracle's constant query scales past n_ref
    online_every: int | None = None  # online arms: rows per chunk M; None: calibrate.online's default
    online_steps: int | None = None  # AdamW steps G per chunk
    online_lr: float | None = None  # AdamW learning rate
    online_rank: int | None = None  # online-lora's rank r
    online_carry: bool = False  # keep the learnt weights from one sequence to the next
    resume: bool = False  # continue an interrupted run from <out>.partial
    device: str = "auto"  # auto, cpu or cuda
    dtype: str = "auto"  # auto, float32, bfloat16
    threads: int = 0  # CPU threads for torch; 0: torch's default
    out: Path | None = None  # where the JSON result goes (atomically)
    plot: Path | None = None  # where the PNG of mass and agreement versus n goes
    rows_per_bucket: int = 96  # query rows metered per bucket and sequence (not an option of the command)
    online: OnlineOptions | None = field(init=False, default=None)  # how the online arms learn; None: no online arm
    lookup: LookupSettings = field(init=False, default=LookupSettings())  # the lookup variants' n-gram range

    def __post_init__(self):
        settle = partial(object.__setattr__, self)  # frozen: what the checks settle is set once, here
        drafter_kind(self.drafter, evaluates=True)
        for name in ("spec_file", "out", "plot"):  # a path given as text
            if getattr(self, name) is not None:
                settle(name, Path(getattr(self, name)))
        edges = bucket_edges(list(self.lengths))
        settle("lengths", tuple(int(n) for n in edges))
        longest = self.lengths[-1]
        names = list(self.variants)
        if self.reference_drafter_path is not None and "reference" not in names:
            names.append("reference")  # the reference head is a variant once given
        settle("variants", check_variants(names, window=self.window, sinks=self.sinks,
                                          has_reference=self.reference_drafter_path is not None,
                                          neighbour_window=self.neighbour_window, group=self.group, n_ref=self.n_ref,
                                          longest=longest))
        if (self.reference_drafter_path is not None and not Path(self.reference_drafter_path).exists()
                and self.drafter == "eagle3"):
            raise UserError(f"--reference-drafter-path {self.reference_drafter_path}: no such folder")
        self._check_counts()
        from ..drafters.pointer import check_unmatched

        check_unmatched(self.pointer_unmatched, default_drafter_path(self.drafter, self.drafter_path))
        settle("online", online_options(self.variants, kind=self.drafter, every=self.online_every,
                                        steps=self.online_steps, lr=self.online_lr, rank=self.online_rank,
                                        carry=self.online_carry, speculative=self.speculative, resume=self.resume))
        settle("temperature", check_temperature(self.temperature))
        if self.seed is not None and not self.sample:
            raise UserError(f"--seed {self.seed}: seeds the draws of --sample only, and greedy decoding draws nothing; "
                            "add --speculative --sample, or drop --seed")
        settle("seed", check_seed(0 if self.seed is None else self.seed))
        if self.sample and not self.speculative:
            raise UserError("--sample: samples in speculative decoding; add --speculative")
        if self.n_ref is not None and not 2 <= self.n_ref < longest:
            raise UserError(f"--n-ref {self.n_ref}: expected at least 2 and below the largest of --lengths "
                            f"({longest}), so that some bucket lies beyond it")
        if self.plot is not None and self.plot.suffix.lower() != ".png":
            raise UserError(f"--plot {self.plot}: give a .png file name")
        check_outputs({"--out": self.out, "--plot": self.plot},
                      {**local_inputs(spec=self.spec_file, corpus=self.corpus, drafter_path=self.drafter_path,
                                      target_path=self.target_path, reference_drafter_path=self.reference_drafter_path),
                       **{f"--extra-spec {name.removeprefix(EXTRA_PREFIX)}": path
                          for name, file in self.extra_spec_files.items()
                          for path in local_inputs(file=file).values()}})
        settle("lookup", check_lookup(self.lookup_max_ngram, self.lookup_min_ngram))
        settle("bin_size", self._check_bin_size(longest))
        check_corpus(self.corpus, longest, drafter=self.drafter, drafter_path=self.drafter_path,
                     target_path=self.target_path)
        settle("top_k", self.top_k or (self.spec.top_k if self.spec is not None else 4))
        self._check_specs()
        if self.n_ref is not None:  # the grid's specs are checked before loading when n_ref is known
            scale_grid(list(self.slopes), list(self.alphas), self.n_ref, self.top_k)

    def check_online_drafter(self) -> None:
        """Before the drafter loads: eval's online arms adapt and score an EAGLE-3 head alone, so a drafter folder
        with a copy pointer (the built-in default among them) is refused (:func:`refuse_online_pointer`)."""
        from ..drafters.pointer import locate

        path = default_drafter_path(self.drafter, self.drafter_path)
        if self.online is not None and path is not None and Path(path).is_dir():  # else the loader says what's missing
            pointer, head = locate(path)
            if pointer is not None:
                refuse_online_pointer(path, head)

    def _check_counts(self) -> None:
        """``--sequences``, ``--threads``, ``--skip``, ``--num-draft``, ``--new-tokens`` and ``--top-k``: each at
        least its least."""
        if self.sequences is not None and self.sequences < 1:
            raise UserError(f"--sequences {self.sequences}: expected at least 1 (default: every held-out sequence)")
        for option, value, least in (("--threads", self.threads, 0), ("--skip", self.skip, 0),
                                     ("--num-draft", self.num_draft, 1), ("--new-tokens", self.new_tokens, 2)):
            if value is not None and value < least:
                raise UserError(f"{option} {value}: need at least {least}")
        if self.top_k is not None and self.top_k < 1:
            raise UserError(f"--top-k {self.top_k}: need at least 1 (or leave it out for the spec's)")

    def _check_bin_size(self, longest: int) -> int | None:
        """``--bin-size``: on a generated corpus, 1 to the longest length (default :data:`DEFAULT_BIN_SIZE`, or the
        longest length when shorter); refused on another corpus, which has no output positions."""
        if not is_generated(self.corpus):
            if self.bin_size is not None:
                raise UserError(f"--bin-size {self.bin_size}: bins the output positions of a generated corpus; "
                                f"{self.corpus} has none: drop --bin-size or name --corpus generated:NAME")
            return None
        if self.bin_size is None:
            return min(DEFAULT_BIN_SIZE, longest)
        if not 1 <= self.bin_size <= longest:
            raise UserError(f"--bin-size {self.bin_size}: expected 1 to the longest of --lengths ({longest}) output "
                            "tokens per bin")
        return int(self.bin_size)

    def _check_specs(self) -> None:
        """The spec and the extra specs at the run's top-k (every variant's mass is read at one k), each extra
        spec named ``spec:NAME``."""
        if self.spec is not None and self.spec.top_k != self.top_k:
            raise UserError(f"--top-k {self.top_k}: the spec's top_k is {self.spec.top_k}; give the spec at "
                            f"top_k {self.top_k}")
        for name, spec in self.extra_specs.items():
            if not (name.startswith(EXTRA_PREFIX) and EXTRA_NAME.fullmatch(name.removeprefix(EXTRA_PREFIX))):
                raise ValueError(f"extra spec variant {name!r}: expected {EXTRA_PREFIX}NAME")
            if spec.top_k != self.top_k:
                raise UserError(f"--extra-spec {name.removeprefix(EXTRA_PREFIX)}: its top_k {spec.top_k} is not the "
                                f"run's {self.top_k}; every variant's mass is read at one top-k")

    @property
    def edges(self) -> np.ndarray:
        """The bucket upper edges, sorted and distinct (``calibrate.eval.variants.bucket_edges``)."""
        return np.asarray(self.lengths)

    def to_dict(self) -> dict:
        """The run's parameters as ``<out>.partial/run.json`` keeps them: ``--resume`` goes on only with the same."""
        looked = set(LOOKUP_VARIANTS) & set(with_lookup(self.variants, self.corpus))

        # the drafter as loaded: a run saved before the built-in default changed does not resume with another
        return {"drafter": self.drafter, "drafter_path": default_drafter_path(self.drafter, self.drafter_path),
                "target_path": self.target_path, "spec": None if self.spec is None else self.spec.to_dict(),
                "lengths": list(self.lengths),
                "corpus": self.corpus, "sequences": self.sequences, "skip": self.skip, "top_k": self.top_k,
                "speculative": self.speculative, "new_tokens": self.new_tokens, "num_draft": self.num_draft,
                "variants": list(self.variants), "window": self.window, "sinks": self.sinks, "n_ref": self.n_ref,
                "reference_drafter_path": self.reference_drafter_path, "temperature": self.temperature,
                "slopes": list(self.slopes), "alphas": list(self.alphas), "dtype": self.dtype,
                "neighbour_window": self.neighbour_window, "group": self.group, "sample": self.sample,
                "seed": self.seed, "lookup": self.lookup.to_dict() if looked else None,
                "online": None if self.online is None else self.online.to_dict(),
                "extra_specs": {name: extra.to_dict() for name, extra in self.extra_specs.items()} or None,
                **({"bin_size": self.bin_size} if self.bin_size is not None else {}),
                **({"pointer_unmatched": self.pointer_unmatched} if self.pointer_unmatched is not None else {})}

    @classmethod
    def from_cli(cls, *, lengths: str, variants: str, slopes: str | None, alphas: str | None,
                 spec: Path | None, extra_spec: list[str] | None, top_k: int | None, **options) -> EvalOptions:
        """The options of the command's text values: ``lengths`` and ``variants`` comma-separated,
        ``slopes`` and ``alphas`` grids, ``spec`` a file and ``extra_spec`` ``NAME=FILE`` values, read
        at the run's top-k (``top_k``, else the spec's, else 4); the others as ``EvalOptions`` takes them."""
        edges, grids = _lengths(lengths), (parse_grid("--slopes", slopes), parse_grid("--alphas", alphas))
        files = parse_extra_specs(extra_spec)
        loaded = load_spec(spec) if spec is not None else None
        k = top_k if top_k is not None and top_k >= 1 else None  # a bad --top-k is EvalOptions' to refuse
        k = k or (loaded.top_k if loaded else 4)
        extras = {name: at_top_k(load_spec(file), k, f"--extra-spec {name.removeprefix(EXTRA_PREFIX)}={file}")
                  for name, file in files.items()}
        return cls(lengths=tuple(edges), variants=tuple(_variants(variants)), slopes=tuple(grids[0]),
                   alphas=tuple(grids[1]), spec=None if loaded is None else at_top_k(loaded, k, f"--spec {spec}"),
                   spec_file=spec, extra_specs=extras, extra_spec_files=files, top_k=top_k, **options)


def refuse_online_pointer(path, head) -> None:
    """eval's online arms on a drafter with a copy pointer at ``path`` (the head at ``head``): they would adapt and
    score the head alone beside arms that mix the pointer in, so one line says what to run instead."""
    raise UserError(f"--variants online-...: eval's online arms adapt the head alone, and the drafter {path} has a "
                    f"copy pointer; pass the head itself, --drafter-path {head}, or run them with sharpdraft bench, "
                    "where the pointer stays around the learning head")
