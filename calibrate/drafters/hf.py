"""``hf`` and ``pard`` drafters: any ``AutoModelForCausalLM``, tapped through ``AttentionInterface``.

PARD drafters (AMD-AGI/PARD) are plain causal LMs whose config adds a ``pard_token``; for
calibration they run exactly like any causal LM: one causal prefill per sequence, every query
row ``i`` sees ``i + 1`` keys. Only the base model runs (no ``lm_head``), since the logits over
the vocabulary are not needed.

Loading (``load``): no ``--drafter-path`` with ``--drafter hf`` is the embedded
SmolLM2-135M-Instruct (``calibrate.smollm2``); otherwise a local folder, a ``.gguf`` file or a hub
id (``calibrate.drafters.target``); a folder written by ``scripts/train_pard.py`` (its config names
``sharpdraft_embedding_from``) is put together by ``calibrate.drafters.pard_smollm2.build_pard_drafter``
with its base model's embedding. Tokenizer: the drafter folder's own tokenizer files, else the
``--target-path`` folder's (PARD and other drafters share their target's vocabulary), else, for a
drafter cut from SmolLM2, SmolLM2's; with none, a ``UserError`` says so. The target (``sharpdraft eval`` compares the drafter with it) is
the ``--target-path`` model, else SmolLM2, loaded when first needed.

Evaluation: teacher-forced runs are one causal pass each, its queries scaled through the
attention tap (``calibrate.taps.ScalingTap``, the runtime's own scaling). In speculative decoding
(:meth:`CausalLMAdapter.proposer`, the one loop of ``calibrate.speculative``) an ``hf`` drafter drafts
chains, one token per drafter forward (``calibrate.drafters.causal.CausalLMProposer``); a ``pard``
drafter drafts as PARD does: ``K`` drafts from one forward over the pending token and ``K - 1``
copies of its ``pard_token`` (``calibrate.drafters.parallel``). Both apply the spec through the same
tap as the teacher-forced pass.

Default ``n_ref`` (the reference length; ``--n-ref`` overrides it):

* embedded SmolLM2: 2048, its pre-training context;
* ``hf``: the config's ``max_position_embeddings`` (the only length a config states; pass
  ``--n-ref`` with the real training length when you know it);
* ``pard``: the config's ``max_seq_length`` if present, else 512, the length of PARD's example
  training recipes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from sharpdraft_theory import ScaleSpec
from sharpdraft_theory.spec import DrafterInfo

from ..errors import UserError
from ..smollm2 import SMOLLM2_N_REF, load_smollm2
from ..taps import ScalingTap, attention_tap
from .base import AttentionTap, ForcedRows, TeacherForced, forced_runs
from .checkpoint import read_config
from .fields import check_fields
from .pard_smollm2 import EMBEDDING_FROM, SMOLLM2, build_pard_drafter
from .target import eos_token_id, has_tokenizer, load_causal_lm, load_target, load_tokenizer

__all__ = ["CausalLMAdapter", "load", "PARD_DRAFTER_DIR", "PARD_N_REF"]

# built in for --drafter pard: a PARD drafter for SmolLM2 trained by scripts/train_pard.py (its TRAINING.md)
PARD_DRAFTER_DIR = Path(__file__).resolve().parent.parent / "assets" / "pard-smollm2"

PARD_N_REF = 512  # PARD's example recipes train at max_seq_length 512


class CausalLMAdapter:
    """A causal LM as a drafter: the ``Adapter`` protocol of ``calibrate.drafters.base``.

    ``target`` is the target model, or a function that loads it (called once, when first needed).
    """

    predicts = 1  # teacher-forced row t guesses token t + 1
    pointer = None  # a copy pointer (calibrate.drafters.pointer), set by __init__ when the folder names one

    def __init__(self, model, tokenizer, *, kind: str, path: str | None, default_n_ref: int,
                 target: nn.Module | Callable[[], nn.Module], pointer=None):
        self.model = model
        self.pointer = pointer  # a copy pointer mixed into every law (calibrate.drafters.pointer), or None
        self.tokenizer = tokenizer
        self.kind = kind
        self.default_n_ref = int(default_n_ref)
        cfg = model.config.get_text_config()
        heads = cfg.num_attention_heads
        self.info = DrafterInfo(kind=kind, path=path, num_layers=cfg.num_hidden_layers, num_heads=heads,
                                num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                                head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        self.device = model.get_input_embeddings().weight.device
        self.eos_token_id = eos_token_id(tokenizer)
        self._target = target

    @property
    def target(self) -> nn.Module:
        if not isinstance(self._target, nn.Module):
            self._target = self._target()
        return self._target

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def collect(self, input_ids: torch.Tensor, tap: AttentionTap, positions: torch.Tensor) -> None:
        """One causal prefill of ``input_ids`` (1, T); the tap keeps the rows it wants."""
        with torch.no_grad(), attention_tap(self.model, tap):
            self.model.base_model(input_ids=input_ids.to(self.device), use_cache=False)

    @torch.no_grad()
    def teacher_forced(self, input_ids: torch.Tensor, runs: Sequence[tuple[ScaleSpec | None, AttentionTap | None]],
                       temperature: float = 1.0, proposals: torch.Tensor | None = None) -> TeacherForced:
        """Row ``t`` of (1, T): the drafter's and the target's next-token laws after token ``t`` (``predicts``);
        the copy pointer, when the drafter has one, wraps the drafter's arm (``calibrate.drafters.pointer``)."""
        from ..measure.metrics import NextTokenLaw
        from .pointer import PointerArm

        input_ids = input_ids.to(self.device)
        law = NextTokenLaw(self.target(input_ids=input_ids).logits[0], temperature, points=proposals)  # (T, vocab)
        arm = _CausalArm(self.model, input_ids)
        if self.pointer is not None:
            arm = PointerArm(arm, self.pointer, input_ids[0], self.model.get_output_embeddings().weight.shape[0])
        return forced_runs(arm, runs, law, input_ids.shape[1])

    feature_ids = None  # its proposers read no target features

    def proposer(self, spec: ScaleSpec | None):
        """Drafting with ``spec`` applied: a PARD drafter's parallel drafts (``calibrate.drafters.parallel``),
        any other causal LM's chain (``calibrate.drafters.causal``); the copy pointer around them when the
        drafter has one."""
        from .causal import CausalLMProposer
        from .parallel import PardParallelProposer
        from .pointer import with_pointer

        if self.model is self.target:
            raise UserError("--speculative needs a drafter different from the target: pass --drafter-path "
                            "(and --target-path for the target)")
        if self.kind == "pard":
            proposer = PardParallelProposer(self.model, self.pard_token, spec)
        else:
            proposer = CausalLMProposer(self.model, spec)
        return proposer if self.pointer is None else with_pointer(proposer, self.pointer, spec)

    @property
    def parallel(self) -> bool:
        """PARD drafts K tokens in one forward: eval adds per-position metrics (``calibrate.measure.blocks``); a
        checkpoint without a usable ``pard_token`` cannot, and is measured teacher-forced as a causal LM only."""
        if self.kind != "pard":
            return False
        try:
            self.pard_token  # noqa: B018
        except UserError:
            return False
        return True

    @property
    def pard_token(self) -> int:
        """The reserved token a PARD drafter reads K - 1 copies of (config ``pard_token``)."""
        token = getattr(self.model.config.get_text_config(), "pard_token", None)
        vocab = self.model.get_input_embeddings().weight.shape[0]
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
            raise UserError(f"--drafter pard {self.info.path}: config.json has pard_token {token!r}, not a token id "
                            f"below the embedding's {vocab} rows; a PARD drafter names its mask token there (or run it "
                            "as --drafter hf, one draft per forward)")
        return token


class _CausalArm:
    """The teacher-forced arm of a causal LM (``calibrate.drafters.base.ForcedArm``): one causal pass over
    ``input_ids`` (1, T), its queries scaled through the attention tap; row ``t`` guesses token ``t + 1``."""

    columns = None

    def __init__(self, model, input_ids: torch.Tensor):
        self.model, self.input_ids = model, input_ids

    def __call__(self, spec, tap):
        scaled = ScalingTap(spec, tap)
        with attention_tap(self.model, scaled, restrict=spec):
            logits = self.model(input_ids=self.input_ids, use_cache=False).logits[0]  # (T, vocab)
        rows = torch.arange(logits.shape[0], device=logits.device)
        yield ForcedRows(rows, logits, rows, rows, scaled.n_visible[0])


def load(kind: str, drafter_path: str | None, target_path: str | None, device: torch.device,
         dtype: torch.dtype) -> CausalLMAdapter:
    """Load an ``hf`` or ``pard`` drafter (see the module docstring for paths and presets)."""
    def target():
        return load_target(target_path, device, dtype)[0]

    given = drafter_path
    if drafter_path is None and kind == "pard":  # the built-in PARD drafter for SmolLM2
        if not (PARD_DRAFTER_DIR / "config.json").is_file():
            raise UserError(f"the PARD drafter for SmolLM2 is missing ({PARD_DRAFTER_DIR}); train one with "
                            "scripts/train_pard.py or pass --drafter-path DIR")
        drafter_path = str(PARD_DRAFTER_DIR)
    if drafter_path is None:
        model, tokenizer = load_smollm2(device, dtype)
        return CausalLMAdapter(model, tokenizer, kind="hf", path=None, default_n_ref=SMOLLM2_N_REF, target=target)
    from .pointer import locate

    pointer = None
    if Path(drafter_path).expanduser().is_dir():  # a copy pointer folder names the drafter it joins
        pointer, folder = locate(Path(drafter_path).expanduser())
        if pointer is not None and kind != "pard":
            raise UserError(f"--drafter-path {drafter_path}: a copy pointer joins an eagle3, dflash or pard drafter; "
                            f"pass --drafter pard, or the drafter's own folder")
        drafter_path = drafter_path if pointer is None else str(folder)
    config = _check_pard_fields(drafter_path)
    if config is not None and EMBEDDING_FROM in config:  # a scripts/train_pard.py folder: layers without embedding
        model = build_pard_drafter(Path(drafter_path).expanduser(), device, dtype)
        if target_path is None and config[EMBEDDING_FROM] == SMOLLM2 and not has_tokenizer(drafter_path):
            tokenizer = load_smollm2(device, dtype)[1]  # cut from SmolLM2: its vocabulary, its tokenizer
        else:
            tokenizer = load_tokenizer(drafter_path, option="--drafter-path", shared_with=target_path)
    else:
        model = load_causal_lm(drafter_path, device, dtype, option="--drafter-path")
        tokenizer = load_tokenizer(drafter_path, option="--drafter-path", shared_with=target_path)
    return CausalLMAdapter(model, tokenizer, kind=kind, path=given,
                           default_n_ref=_default_n_ref(kind, model.config), target=target, pointer=pointer)


def _check_pard_fields(drafter_path: str) -> dict | None:
    """The folder's config (None when it has none, e.g. a hub id or a .gguf file), after refusing a PARD-2
    checkpoint (``calibrate.drafters.fields``, format pard): its ``pard2`` / ``spd_type: pard2`` fields add a
    target-feature term a plain causal-LM run would drop."""
    path = Path(drafter_path).expanduser() / "config.json"
    if not path.is_file():
        return None
    config = found = read_config(path, "PARD")
    if config.get("spd_type") == "pard2" and not config.get("pard2"):
        config = {**config, "pard2": True}  # either spelling marks PARD-2 (pard2_infer.py reads both)
    if config.get("pard2") is False:
        config = {k: v for k, v in config.items() if k != "pard2"}
    check_fields(config, "pard", str(path), strict=False)
    return found


def _default_n_ref(kind: str, config) -> int:
    cfg = config.get_text_config()
    if kind == "pard":
        return int(getattr(cfg, "max_seq_length", None) or PARD_N_REF)
    return int(cfg.max_position_embeddings)
