"""Online adaptation, the rival of a training-free scale: the drafter learns the text while it drafts.

Two arms of ``sharpdraft eval`` for EAGLE-3 heads, after Online Speculative Decoding (Liu et al.
2023, arXiv 2310.07177: the drafter distilled on what the target verified, forward KL to the
target's distribution) and OnlineSpec (Qian et al. 2026, arXiv 2603.12617: an EAGLE-3 head
fine-tuned on the target's outputs chunk by chunk with its training loss):

``online-full``
    every weight the head's training updates (``scripts/train_demo_eagle3.py`` trains all but the
    embedding it shares with the target: ``fc``, the midlayer, ``norm`` and the head's own
    ``lm_head``) takes AdamW steps;
``online-lora``
    the head stays as it is and a rank-``r`` update ``W + B A`` (LoRA, Hu et al. 2021,
    arXiv 2106.09685; ``B = 0`` at the start, so the arm starts as the head itself) of each
    attention and MLP projection of the midlayer (``q, k, v, o, gate, up, down``) takes them;
``online-full+spec``, ``online-lora+spec``
    the same with the spec under test in the head's attention, while scoring and while learning.

**Predict, then learn.** The head's rows of a sequence are cut into chunks of ``M`` rows
(``every``). Chunk ``c`` is scored (greedy agreement, expected acceptance, mass) with the weights
as they were after chunks ``0 .. c-1``; then the arm takes ``G`` (``steps``) AdamW steps on
chunk ``c``, the tokens just verified, so no row is ever scored by weights that learnt from it.
The loss is training's: forward KL from the target's next-token law restricted to the draft
vocabulary and renormalised (softmax of the target's logits at those columns, temperature 1) to
the head's, ``sum_x p(x) (log p(x) - log q(x))``, averaged over the chunk's rows. The rows before
the chunk enter its attention as keys and values computed with the current weights, without
gradient (the cache a deployed drafter holds). The target, the shared embedding and the
checkpoint's weights are never changed: ``online-full`` trains a copy, ``online-lora`` its own
``A`` and ``B``; each sequence starts from the checkpoint again, unless ``carry``.

**While decoding** (``sharpdraft bench``): :class:`OnlineProposer` wraps an EAGLE-3 chain or DFlash
blocks in the one speculative loop and learns from the target's verified positions every ``every``
(T) of them, after Test-Time Speculation (arXiv 2605.09329: online distillation during the
generation), with the same learner and loss; an EAGLE-3 head's rows, a DFlash model's blocks or a PARD
model's mask rows (:class:`ChainRows`, :class:`BlockRows`, :class:`ParallelRows`), LoRA on every layer's
projections for DFlash and PARD.

Memory: :func:`extra_bytes` counts, from the tensors themselves, what an arm holds beyond the
drafter: its trainable weights (the copy for ``online-full``, ``A`` and ``B`` for ``online-lora``),
their gradients and AdamW's moments and step counts. A spec holds none (its ``alpha(n)`` is a
function of the count, applied to the query in place): 0 bytes. :class:`PeakMemory` measures the
peak of each pass (CUDA's peak allocated bytes; on a CPU the process's peak resident set, reset
before each pass).
"""

from __future__ import annotations

import ctypes
import math
import re
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from sharpdraft_theory import ScaleSpec

from .drafters import default_drafter_path, drafter_kind
from .drafters.base import TeacherForced
from .errors import UserError
from .taps import ScalingTap
from .training.loss import distillation_loss

__all__ = ["ONLINE_METHODS", "ONLINE_VARIANTS", "DECODING_LR", "OnlineOptions", "OnlineArm", "online_options",
           "online_arms", "check_rank", "check_rank_unloaded", "Learner", "OnlineSequence", "online_pass",
           "OnlineProposer", "OnlineChainProposer", "OnlineBlockProposer", "ChainRows", "BlockRows", "ParallelRows",
           "online_proposer", "learning", "tally_online", "extra_bytes", "PeakMemory"]

ONLINE_METHODS = ("online-full", "online-lora")
ONLINE_VARIANTS = (*ONLINE_METHODS, *(f"{m}+spec" for m in ONLINE_METHODS))  # alone and with the spec

# Defaults (docs/eval.md, "Online adaptation", gives the reasons at length):
DEFAULT_EVERY = 64  # M: rows per chunk, about 16 verification rounds of a chain of 4 drafts
DEFAULT_STEPS = 1  # G: one step per chunk, the online-gradient form of both papers
DEFAULT_LR = {"online-full": 1e-4, "online-lora": 1e-3}  # EAGLE-3 training's order; LoRA's usual 10x
# while decoding (sharpdraft bench), from a sweep on two train prompts (docs/longgen.md): a generation gives a drafter
# few updates (3 in 256 tokens at T = 64), too few for LoRA at 1e-3 to move at all; online-full gained as much at
# 1e-4 as at 1e-3 (and lost at 1e-2), so it keeps eval's rate
DECODING_LR = {"online-full": 1e-4, "online-lora": 1e-2}
DEFAULT_RANK = 8  # r: the common LoRA rank (PEFT's default)
BETAS = (0.9, 0.95)  # AdamW as the demo head was trained (scripts/train_demo_eagle3.py), no weight decay
MAX_EVERY, MAX_STEPS, MAX_LR, MAX_RANK = 8192, 64, 1.0, 256  # bounds past which a value is a typo
# adapted projections: an EAGLE-3 head's midlayer, each layer of a DFlash model or of a PARD causal LM
LORA_MODULES = re.compile(r"(model\.)?(midlayer|layers\.\d+)\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)")
# never learnt: the embedding a head shares with the target; a PARD model's LM head too (the target's token space,
# frozen in PARD's training as in calibrate.training.pard)
SHARED = re.compile(r"(.*\.)?embed_tokens\..*")
SHARED_PARD = re.compile(r"(.*\.)?(embed_tokens|lm_head)\..*")
LORA_SEED = 0  # A's initialisation is drawn from this seed: runs repeat exactly


@dataclass(frozen=True)
class OnlineOptions:
    """How the online arms learn (``--online-*``)."""

    every: int = DEFAULT_EVERY  # M: rows per chunk; each is scored, then learnt from
    steps: int = DEFAULT_STEPS  # G: AdamW steps on each chunk after it is scored
    lr: float | None = None  # AdamW learning rate (None: DEFAULT_LR of the method, DECODING_LR while decoding)
    rank: int = DEFAULT_RANK  # r of online-lora's B A
    carry: bool = False  # keep the learnt weights from one sequence to the next (default: reset)
    decoding: bool = False  # learning while decoding (OnlineProposer): DECODING_LR are the default rates

    def lr_of(self, method: str) -> float:
        """The learning rate ``method`` uses."""
        return (DECODING_LR if self.decoding else DEFAULT_LR)[method] if self.lr is None else self.lr

    def to_dict(self) -> dict:
        """The options as results record them: every field but ``decoding``, with each method's rate."""
        d = {**asdict(self), "lr": {m: self.lr_of(m) for m in ONLINE_METHODS}}
        d.pop("decoding")
        return d


@dataclass(frozen=True)
class OnlineArm:
    """One online arm: its name, how it learns and the spec it runs under."""

    name: str  # online-full, online-lora, online-full+spec, online-lora+spec
    method: str  # online-full or online-lora
    spec: ScaleSpec | None  # in the head's attention while scoring and learning (None: the head as it is)


def online_options(names, *, kind: str, every: int | None = None, steps: int | None = None,
                   lr: float | None = None, rank: int | None = None, carry: bool = False,
                   speculative: bool = False, resume: bool = False, decoding: bool = False) -> OnlineOptions | None:
    """Check the online options against ``--variants`` ``names`` before any model loads; ``decoding``: for arms
    that learn in the decoding loop (``sharpdraft bench``, :class:`OnlineProposer`), else teacher-forced.

    Returns the options, or None when no online arm is asked for (then an ``--online-*`` option
    is refused: it would change nothing).
    """
    asked = [n for n in names if n in ONLINE_VARIANTS]
    given = [o for o, v in (("--online-every", every), ("--online-steps", steps), ("--online-lr", lr),
                            ("--online-rank", rank)) if v is not None] + (["--online-carry"] if carry else [])
    if not asked:
        if given:
            raise UserError(f"{given[0]}: no online arm to apply it to; add online-full or online-lora to --variants")
        return None
    if decoding and not drafter_kind(kind).online_decoding:  # the kinds registry says which adapt where
        raise UserError(f"--variants {asked[0]}: online adaptation while decoding is for EAGLE-3, DFlash and PARD "
                        f"drafters only (--drafter eagle3, dflash or pard), not {kind}")
    if not decoding and not drafter_kind(kind).online:
        raise UserError(f"--variants {asked[0]}: online adaptation is for EAGLE-3 heads only for now "
                        f"(--drafter eagle3), not {kind}")
    if speculative:
        raise UserError(f"--variants {asked[0]} with --speculative: online arms run teacher-forced only for now; "
                        "drop --speculative or the online variants")
    if carry and resume:
        raise UserError("--online-carry with --resume: the carried weights are not saved; rerun without --resume")
    for option, value, most in (("--online-every", every, MAX_EVERY), ("--online-steps", steps, MAX_STEPS),
                                ("--online-rank", rank, MAX_RANK)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most):
            raise UserError(f"{option} {value}: expected an integer from 1 to {most}")
    if lr is not None and not (math.isfinite(lr) and 0 < lr <= MAX_LR):
        rates = DECODING_LR if decoding else DEFAULT_LR
        raise UserError(f"--online-lr {lr}: expected a learning rate above 0 and at most {MAX_LR:g} "
                        f"(default {rates['online-full']:g} for online-full, {rates['online-lora']:g} "
                        "for online-lora)")
    return OnlineOptions(every=DEFAULT_EVERY if every is None else every,
                         steps=DEFAULT_STEPS if steps is None else steps,
                         lr=None if lr is None else float(lr), rank=DEFAULT_RANK if rank is None else rank,
                         carry=bool(carry), decoding=decoding)


def online_arms(names, spec: ScaleSpec) -> list[OnlineArm]:
    """The online arms among ``names``, in their order."""
    return [OnlineArm(n, n.removesuffix("+spec"), spec if n.endswith("+spec") else None)
            for n in names if n in ONLINE_VARIANTS]


# ----------------------------------------------------------------------------------------------
# The learner: what changes, and how it runs the head
# ----------------------------------------------------------------------------------------------

class Learner:
    """The trainable state of one online arm on an EAGLE-3 head (or a DFlash or PARD model), and the head run
    with it.

    ``online-full``: a copy of every head parameter but the shared embedding (``shared``: the names not
    learnt; a PARD model's LM head too), run in place of the head's own (:meth:`Learner.applied`).
    ``online-lora``: ``A`` (r, in) drawn as ``nn.Linear`` draws a weight and ``B`` (out, r) zero for each projection of
    :data:`LORA_MODULES`, added to the projection's output by a forward hook for the length of
    each call, ``y = W x + B (A x)`` (scale 1, i.e. LoRA's alpha = r), in float32. The head's
    own tensors are only read.
    """

    def __init__(self, head: nn.Module, method: str, options: OnlineOptions, shared: re.Pattern = SHARED):
        if method not in ONLINE_METHODS:
            raise ValueError(f"method {method!r}: expected one of {ONLINE_METHODS}")
        self.head, self.method = head, method
        self.lora: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if method == "online-full":
            self.full = {name: p.detach().clone().requires_grad_(True) for name, p in head.named_parameters()
                         if not shared.fullmatch(name)}
            params = list(self.full.values())
        else:
            self.full = None
            gen = torch.Generator().manual_seed(LORA_SEED)
            check_rank(head, options.rank)
            for name, module in head.named_modules():
                if not LORA_MODULES.fullmatch(name):
                    continue
                out_features, in_features = module.weight.shape
                bound = in_features ** -0.5  # nn.Linear's (and LoRA's) kaiming-uniform(a = sqrt 5) bound
                a = ((torch.rand(options.rank, in_features, generator=gen) * 2 - 1) * bound)
                b = torch.zeros(out_features, options.rank)
                self.lora[name] = (a.to(module.weight.device).requires_grad_(True),
                                   b.to(module.weight.device).requires_grad_(True))
            params = [t for pair in self.lora.values() for t in pair]
        self.params = params
        self.optimizer = torch.optim.AdamW(params, lr=options.lr_of(method), betas=BETAS, weight_decay=0.0)
        self.gradient_bytes = 0  # measured at the last step, from the gradients themselves

    def __call__(self, *args, **kwargs):
        """The head's forward with this arm's weights: ``head(*args, **kwargs)``."""
        with self.applied():
            return self.head(*args, **kwargs)

    @contextmanager
    def applied(self):
        """While the block runs, the head computes with this arm's weights: ``online-full``'s copy stands in
        for the head's parameters, ``online-lora``'s hooks add ``B (A x)``; both undone on leaving, so a
        proposer that calls the head (``calibrate.drafters.eagle3.Eagle3Proposer``) drafts with them. The
        head's own parameters (the shared embedding among them) take no gradient meanwhile: a step's
        backward reaches this arm's tensors only."""
        modules = dict(self.head.named_modules())
        with frozen(self.head):
            if self.full is None:
                handles = [modules[name].register_forward_hook(_lora_hook(a, b)) for name, (a, b) in self.lora.items()]
                try:
                    yield
                finally:
                    for handle in handles:
                        handle.remove()
                return
            owners = [(modules[name.rpartition(".")[0]], name.rpartition(".")[2], tensor)
                      for name, tensor in self.full.items()]
            saved = [module._parameters[attr] for module, attr, _ in owners]
            for module, attr, tensor in owners:
                module._parameters[attr] = tensor
            try:
                yield
            finally:
                for (module, attr, _), param in zip(owners, saved):
                    module._parameters[attr] = param

    def step(self, loss: torch.Tensor) -> None:
        """One AdamW step down ``loss``."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.gradient_bytes = sum(p.grad.nbytes for p in self.params if p.grad is not None)
        self.optimizer.step()

    def extra_bytes(self) -> dict:
        """What this arm holds beyond the drafter, counted from its tensors: ``{"weights", "gradients",
        "optimizer", "total"}`` in bytes (gradients as at the last step; the optimizer's state after
        its first step)."""
        weights = sum(p.nbytes for p in self.params)
        optimizer = sum(v.nbytes for state in self.optimizer.state.values() for v in state.values()
                        if torch.is_tensor(v))
        return {"weights": weights, "gradients": self.gradient_bytes, "optimizer": optimizer,
                "total": weights + self.gradient_bytes + optimizer}


def check_rank(head: nn.Module, rank: int) -> None:
    """``--online-rank``: at most the narrower side of every adapted projection of ``head``."""
    for name, module in head.named_modules():
        if LORA_MODULES.fullmatch(name) and rank > min(module.weight.shape):
            raise UserError(f"--online-rank {rank}: above the width of {name} ({tuple(module.weight.shape)[0]} x "
                            f"{tuple(module.weight.shape)[1]}); choose at most {min(module.weight.shape)}")


def check_rank_unloaded(kind: str, drafter_path: str | None, rank: int) -> None:
    """``--online-rank`` against the EAGLE-3 head, DFlash model or PARD causal LM (``kind``) at ``drafter_path``
    (None: the kind's built-in drafter, whose pointer names the head) before any weight loads: :func:`check_rank`
    on the model its ``config.json`` describes, built on the meta device. A folder without one is left to the
    loader, which says what is missing."""
    from .drafters import dflash, eagle3
    from .drafters.pointer import locate

    folder = Path(default_drafter_path(kind, drafter_path))  # the three kinds have a built-in drafter
    config = locate(folder)[1] / "config.json" if folder.is_dir() else None
    if config is None or not config.is_file():
        return
    with torch.device("meta"):
        if kind == "pard":
            from transformers import AutoConfig, AutoModelForCausalLM

            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config.parent))
        elif kind == "dflash":
            model = dflash.DFlashDraftModel(dflash.DFlashConfig.from_json(config))
        else:
            model = eagle3.Eagle3Head(eagle3.Eagle3Config.from_json(config))
    check_rank(model, rank)


@contextmanager
def frozen(module: nn.Module):
    """While the block runs, ``module``'s parameters take no gradient: autograd neither records through them
    as leaves nor accumulates a ``.grad`` into them (a loaded model's parameters ask for one)."""
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def _lora_hook(a: torch.Tensor, b: torch.Tensor):
    """A forward hook adding ``B (A x)`` to a linear layer's output: x (..., in) -> (..., out)."""

    def hook(module, inputs, output):
        x = inputs[0]
        return output + (x @ a.t().to(x.dtype)) @ b.t().to(x.dtype)

    return hook


def extra_bytes(learner: Learner | None) -> dict:
    """An arm's extra state in bytes; an arm without a learner (a spec, none) holds none."""
    if learner is None:
        return {"weights": 0, "gradients": 0, "optimizer": 0, "total": 0}
    return learner.extra_bytes()


# ----------------------------------------------------------------------------------------------
# One sequence: score a chunk, then learn from it
# ----------------------------------------------------------------------------------------------

class OnlineSequence:
    """One sequence ``input_ids`` (1, T) of an EAGLE-3 drafter adapter, ready to be scored and learnt
    chunk by chunk: head row ``t`` (the adapter's layout) guesses token ``t + 2``; rows ``0 .. T-2``.

    The target runs once (``drafter.target_states``): the head's features, the target's law at
    ``temperature`` (the metrics) and its law at temperature 1 over the draft vocabulary (the
    teacher).
    """

    def __init__(self, drafter, input_ids: torch.Tensor, learner: Learner, spec: ScaleSpec | None = None, *,
                 temperature: float = 1.0, meter=None):
        from .drafters.eagle3 import _restriction
        from .measure.metrics import NextTokenLaw

        head = drafter.head
        self.learner, self.spec, self.meter = learner, spec, meter
        self.restriction = _restriction(spec)
        self.ids = drafter._input(input_ids)
        self.features, final = drafter.target_states(self.ids)  # (1, T, n * width), (T-1, width)
        columns = head.draft_to_target(torch.arange(head.config.draft_vocab_size, device=final.device))
        target_logits = drafter.target.get_output_embeddings()(final)  # (T-1, vocab)
        self.law = NextTokenLaw(target_logits, temperature, columns)
        self.teacher = torch.log_softmax(target_logits[:, columns].float(), dim=-1)  # (T-1, draft): log p
        self.rows = self.ids.shape[1] - 1
        self.drafted = torch.zeros(self.rows, dtype=torch.long, device=final.device)  # filled by score
        self.accept = torch.zeros(self.rows, dtype=torch.float32, device=final.device)
        self._past = None  # (start, cache of rows 0 .. start-1) under the current weights

    def _prefix(self, start: int):
        """The head's cache of rows ``0 .. start-1`` under the current weights, without gradient."""
        if self._past is None or self._past[0] != start:
            with torch.no_grad():
                cache = None if start == 0 else self.learner(self.ids[:, 1:start + 1], self.features[:, :start],
                                                             return_logits=False, **self.restriction).past_key_values
            self._past = (start, cache)
        return self._past[1]

    def _logits(self, start: int, end: int, tap) -> torch.Tensor:
        """Head logits of rows ``start .. end-1`` (end - start, draft), after the cached rows before them."""
        return self.learner(self.ids[:, start + 1:end + 1], self.features[:, start:end],
                            past_key_values=self._prefix(start), attention_hook=tap,
                            **self.restriction).logits[0]

    def score(self, start: int, end: int) -> None:
        """Score rows ``start .. end-1`` with the weights as they are now (greedy guess, acceptance, mass)."""
        with torch.no_grad():
            logits = self._logits(start, end, ScalingTap(self.spec, self.meter))
            self.drafted[start:end] = self.learner.head.draft_to_target(logits.argmax(-1))
            self.accept[start:end] = self.law.acceptance(logits, start)

    def learn(self, start: int, end: int, steps: int) -> None:
        """``steps`` AdamW steps down the forward KL from the teacher to the head on rows ``start .. end-1``."""
        log_p = self.teacher[start:end]  # (rows, draft)
        for _ in range(steps):
            with torch.enable_grad():
                logits = self._logits(start, end, ScalingTap(self.spec)).float()
                loss = distillation_loss(logits, log_p.exp()).mean()  # KL(p || q) + H(p): the KL's gradient
                self.learner.step(loss)
            self._past = None  # the weights moved: the cache is recomputed when next needed

    def result(self) -> TeacherForced:
        """The scored rows as the adapters' ``teacher_forced`` gives them (one run)."""
        n = torch.arange(1, self.rows + 1, device=self.drafted.device)
        return TeacherForced(n_visible=n, target_next=self.law.greedy, drafted=self.drafted[None],
                             accept=self.accept[None])


def online_pass(drafter, input_ids: torch.Tensor, arm: OnlineArm, options: OnlineOptions, *,
                temperature: float = 1.0, meter=None, learner: Learner | None = None):
    """One sequence under ``arm``: every chunk of ``options.every`` rows scored, then learnt from.

    Returns ``(teacher_forced, learner, seconds)``: the rows' guesses and acceptance
    (:class:`~calibrate.drafters.base.TeacherForced`), the learner as the sequence left it (pass it
    back with ``carry``) and the wall time of the whole pass (target pass and updates included).
    """
    if torch.is_inference_mode_enabled():
        raise ValueError("online arms learn: run them under torch.no_grad(), not torch.inference_mode()")
    if not drafter_kind(drafter.kind).online:
        raise UserError(f"{arm.name}: online adaptation is for EAGLE-3 heads only for now, not {drafter.kind}")
    began = time.perf_counter()
    learner = learner or Learner(drafter.head, arm.method, options)
    seq = OnlineSequence(drafter, input_ids, learner, arm.spec, temperature=temperature, meter=meter)
    for start in range(0, seq.rows, options.every):
        end = min(start + options.every, seq.rows)
        seq.score(start, end)
        seq.learn(start, end, options.steps)
    out = seq.result()
    if out.drafted.is_cuda:
        torch.cuda.synchronize()
    return out, learner, time.perf_counter() - began


# ----------------------------------------------------------------------------------------------
# In the decoding loop: a proposer that learns from what the target verified
# ----------------------------------------------------------------------------------------------

class OnlineProposer:
    """A model's proposer that learns while the one loop (``calibrate.speculative.speculative_generate``)
    decodes: Test-Time Speculation's online distillation during the generation (arXiv 2605.09329), with
    OSD's loss (arXiv 2310.07177: forward KL from the target's law to the drafter's).

    ``inner`` drafts and commits with the learner's weights (:meth:`Learner.applied`): an EAGLE-3 chain
    (:class:`ChainRows`) or DFlash blocks (:class:`BlockRows`), which ``rows`` wraps. Each step the loop
    hands over the target's logits of the verified positions (:meth:`verified`) and then their features
    (:meth:`commit`). From the first generated position on, the proposer keeps per position ``t`` the
    token ``x_t``, the target's feature and its law after ``t`` over the draft vocabulary (softmax of its
    logits there, renormalised, temperature 1). Position ``t`` is ready once the law after
    ``t + rows.lead`` is known (the rows that learn from ``t`` read the laws up to there); every
    ``options.every`` ready positions (T) the learner takes ``options.steps`` AdamW steps down
    ``rows.loss`` on them, every position counted (TTS; OSD keeps the rejected ones only). The positions
    before them enter as the proposer's own cache holds them, computed when they were committed and not
    recomputed after an update (a deployed drafter's choice: recomputing costs a drafter pass over the
    whole context every T tokens), so only later positions see the new weights. The prompt is not learnt
    from (the prefill keeps the target's last law only). ``update_seconds``: wall time in the updates,
    inside the loop's ``draft_seconds`` and so its ``decode_seconds``.
    """

    def __init__(self, rows, learner: Learner, options: OnlineOptions):
        self.rows, self.inner, self.learner, self.options = rows, rows.inner, learner, options
        self.name = f"{learner.method}+{self.inner.name}"
        self.feature_ids = self.inner.feature_ids
        self.update_seconds, self.updates = 0.0, 0
        self.buffer_bytes = 0  # the most the pending positions held at once (tokens, features, teacher laws)

    def start(self, prompt: torch.Tensor, features: torch.Tensor, pending: int) -> None:
        with self.learner.applied():
            self.inner.start(prompt, features, pending)
        self.first = prompt.shape[1]  # the first position not learnt from yet (the pending token's at the start)
        self.tokens = [torch.tensor([pending], device=prompt.device)]  # x_t from self.first on, one past the features
        self.features, self.laws = [], []  # per position from self.first: the target's feature, its law after it

    def propose(self, k: int, rule) -> tuple[list[int], np.ndarray | None]:
        with self.learner.applied():
            return self.inner.propose(k, rule)

    def verified(self, logits: torch.Tensor) -> None:
        """The target's logits (a + 1, vocab) after the pending token and each accepted draft."""
        columns = self.rows.columns
        self.laws.append(torch.softmax((logits if columns is None else logits[:, columns]).float(), dim=-1))

    def commit(self, new: list[int], features: torch.Tensor) -> None:
        """Commit through ``inner``, keep the verified positions, and learn from each full chunk of them."""
        with self.learner.applied():
            self.inner.commit(new, features)
        device = self.tokens[0].device
        self.tokens.append(torch.tensor(new, device=device))
        # a drafter that reads no target features (PARD) keeps an empty one per position, to count them
        self.features.append(torch.empty(len(new), 0, device=device) if features is None else features[0])
        self.buffer_bytes = max(self.buffer_bytes, sum(t.nbytes for t in (*self.tokens, *self.features, *self.laws)))
        tokens, feats, laws = (torch.cat(x) for x in (self.tokens, self.features, self.laws))
        ready = min(len(feats), len(laws) - self.rows.lead)
        if ready < self.options.every:
            return
        began = time.perf_counter()
        for _ in range(self.options.steps):
            with torch.enable_grad():
                self.learner.step(self.rows.loss(self.learner, self.first, tokens, feats[None, :ready], laws))
        self.first += ready
        self.tokens, self.features, self.laws = [tokens[ready:]], [feats[ready:]], [laws[ready:]]
        if feats.is_cuda:
            torch.cuda.synchronize()
        self.update_seconds += time.perf_counter() - began
        self.updates += 1

    def extra_bytes(self) -> dict:
        """The learner's bytes (:meth:`Learner.extra_bytes`) and the most the pending positions held (``buffer``)."""
        own = self.learner.extra_bytes()
        return {**own, "buffer": self.buffer_bytes, "total": own["total"] + self.buffer_bytes}

    def close(self) -> None:
        self.inner.close()


class OnlineChainProposer(OnlineProposer):
    """An EAGLE-3 chain that learns (:class:`OnlineProposer`), still a ``ChainProposer``: a copy pointer
    (``calibrate.drafters.pointer.with_pointer``) mixes its rows, drafted with the learnt weights."""

    def __init__(self, rows, learner: Learner, options: OnlineOptions):
        super().__init__(rows, learner, options)
        chain = self.inner
        self.columns, self.vocab_size, self.sliding_window = chain.columns, chain.vocab_size, chain.sliding_window

    def row_logits(self, drafted: list[int]) -> torch.Tensor:
        with self.learner.applied():
            return self.inner.row_logits(drafted)


class OnlineBlockProposer(OnlineProposer):
    """DFlash blocks or PARD's parallel drafts that learn (:class:`OnlineProposer`), still a ``BlockProposer``: a
    copy pointer mixes the rows the learnt weights draft."""

    def draft_logits(self, k: int) -> torch.Tensor:
        with self.learner.applied():
            return self.inner.draft_logits(k)


class ChainRows:
    """What an EAGLE-3 chain (``calibrate.drafters.eagle3.Eagle3Proposer``) learns from: head row ``t`` (the
    target's feature at ``t``, token ``t + 1``) guesses token ``t + 2``, taught by the law after ``t + 1``."""

    lead = 1

    def __init__(self, chain):
        self.inner, self.columns = chain, chain.columns

    def loss(self, learner: Learner, first: int, tokens: torch.Tensor, features: torch.Tensor,
             laws: torch.Tensor) -> torch.Tensor:
        """The mean distillation loss of head rows ``first .. first + r - 1``: ``tokens`` (> r,) ``x_first ..``,
        ``features`` (1, r, n * width), ``laws`` (> r, draft) after ``first ..``; the rows before from the
        chain's cache."""
        chain, r = self.inner, features.shape[1]
        past = tuple(x[:, :, :first] for x in chain.past)
        logits = learner(tokens[None, 1:r + 1], features, past_key_values=past, attention_hook=chain.hook,
                         **chain.restriction).logits[0]
        return distillation_loss(logits.float(), laws[1:r + 1]).mean()


class BlockRows:
    """What DFlash blocks (``calibrate.drafters.blocks.DFlashBlockProposer``) learn from: the block anchored at
    each position ``p`` (token ``x_p``, the context before ``p``), row ``j`` (1 .. B - 1) guessing token
    ``p + j``, taught by the law after ``p + j - 1``; so a position waits for the laws ``B - 2`` further on.
    The output head is the target's and does not learn."""

    def __init__(self, blocks):
        self.inner, self.columns = blocks, blocks.model.draft_ids()
        self.lead = blocks.block_size - 2

    def loss(self, learner: Learner, first: int, tokens: torch.Tensor, features: torch.Tensor,
             laws: torch.Tensor) -> torch.Tensor:
        """The mean distillation loss of the rows of the blocks anchored at ``first .. first + r - 1``: ``tokens``
        (> r,) ``x_first ..``, ``features`` (1, r, ·) their context features (encoded again with gradient), ``laws``
        (>= r + B - 2, draft) after ``first ..``; the context before ``first`` from the blocks' cache; the
        many blocks in one call (``calibrate.drafters.blocks.anchored_masks``)."""
        from .drafters.blocks import _embed, anchored_masks, block_ids, block_tap

        blocks, r = self.inner, features.shape[1]
        model, B = blocks.model, blocks.block_size
        anchors = torch.arange(first, first + r, device=features.device)
        with learner.applied(), frozen(blocks.target):  # the target's embedding and output head: no gradient
            new = model.encode_context(features.to(model.fc.weight.dtype), anchors[None])
            context = [(torch.cat((k[:, :, :first], k1), dim=2), torch.cat((v[:, :, :first], v1), dim=2))
                       for (k, v), (k1, v1) in zip(blocks.context, new)]
            ids, pos = block_ids(model, anchors, tokens[:r])
            with block_tap(model, blocks.spec):
                hidden = model.forward_block(_embed(model, blocks.target, ids), pos, context,
                                             anchored_masks(model, anchors, first + r, blocks.spec))
            logits = model.draft_logits(hidden.view(r, B, -1)[:, 1:], blocks.target)  # (r, B - 1, draft)
        teacher = laws.unfold(0, B - 1, 1)[:r].transpose(1, 2)  # (r, B - 1, draft): block p's row j, law after p+j-1
        return distillation_loss(logits.float(), teacher).mean()


def online_proposer(drafter, method: str, spec: ScaleSpec | None, options: OnlineOptions,
                    draft: int | None = None) -> OnlineProposer:
    """The adapter's proposer under ``spec`` learning as it drafts (an EAGLE-3 chain, DFlash blocks, PARD's parallel
    drafts: ``draft`` of them a forward, the rows it learns), with a fresh :class:`Learner` (``method``), so every
    decode starts from the checkpoint."""
    if not drafter_kind(drafter.kind).online_decoding:
        raise UserError(f"{method}: online adaptation while decoding is for EAGLE-3, DFlash and PARD drafters only, "
                        f"not {drafter.kind}")
    from .drafters.pointer import unwrap, with_pointer

    inner, pointer = unwrap(drafter.proposer(spec))  # a copy pointer stays around the learner: it has no weights
    if drafter.kind == "eagle3":
        online = OnlineChainProposer(ChainRows(inner), Learner(drafter.head, method, options), options)
    elif drafter.kind == "dflash":
        online = OnlineBlockProposer(BlockRows(inner), Learner(drafter.model, method, options), options)
    else:
        if draft is None:
            raise ValueError("a PARD drafter learns the rows it drafts: give draft, the drafts per forward")
        online = OnlineBlockProposer(ParallelRows(inner, draft), Learner(drafter.model, method, options, SHARED_PARD),
                                     options)
    return online if pointer is None else with_pointer(online, pointer, spec)


class ParallelRows:
    """What PARD's parallel drafts (``calibrate.drafters.parallel.PardParallelProposer``) learn from: the forward
    anchored at each position ``p`` (token ``x_p``, then ``K - 1`` mask tokens; ``K = draft``), row ``c`` guessing
    token ``p + c + 1``, taught by the law after ``p + c``; so a position waits for the laws ``K - 1`` further on.
    The many anchors go in one forward in PARD's training layout (``calibrate.drafters.pard_recipe``: each row sees
    the real tokens up to its anchor and its anchor's masks up to itself, what it sees when drafting), after the
    drafter's own cache of the positions before ``first``. The model shares the target's vocabulary (the laws are
    over all of it); its embedding and the LM head tied to it do not learn. A spec's scale applies as when
    drafting (the tap counts each row's visible keys from that mask); a spec's window does not restrict the
    learning forward, whose mask is PARD's own."""

    columns = None  # the target's whole vocabulary

    def __init__(self, parallel, draft: int):
        if draft < 1:
            raise ValueError(f"draft {draft}: a PARD drafter drafts at least one token a forward")
        self.inner, self.draft = parallel, int(draft)
        self.lead = self.draft - 1

    def layout(self, first: int, tokens: torch.Tensor, rows: int):
        """The learning forward's ``(input_ids, position_ids, attention_mask, law_index)`` for the anchors ``first ..
        first + rows - 1``: copy 0 (their real tokens), then each mask copy; the (1, 1, R, first + R) bool mask
        (every row sees the ``first`` cached positions); row ``(c, p)``'s teacher is the law after ``p + c``, at
        index ``p - first + c`` of the laws from ``first``."""
        from .drafters.pard_recipe import visible

        device = tokens.device
        offset = torch.arange(rows, device=device)
        copy = torch.arange(self.draft, device=device).repeat_interleave(rows)  # (K rows,) copy of each row
        anchor = offset.repeat(self.draft) + first
        ids = torch.where(copy == 0, tokens[:rows].repeat(self.draft), torch.full_like(copy, self.inner.pard_token))
        seen = torch.cat((torch.ones(len(copy), first, dtype=torch.bool, device=device), visible(copy, anchor)), 1)
        return ids, anchor + copy, seen[None, None], anchor - first + copy

    def loss(self, learner: Learner, first: int, tokens: torch.Tensor, features: torch.Tensor,
             laws: torch.Tensor) -> torch.Tensor:
        """The mean distillation loss of every row of the forwards anchored at ``first .. first + r - 1``: ``tokens``
        (> r,) ``x_first ..``, ``features`` (1, r, 0) (one per position, none read), ``laws`` (>= r + K - 1, vocab)
        after ``first ..``; the positions before ``first`` from the drafter's cache, not written to."""
        from transformers import DynamicCache

        from .speculative import cached_forward
        from .taps import ScalingTap, attention_tap

        parallel, r = self.inner, features.shape[1]
        model = parallel.model
        ids, positions, mask, index = self.layout(first, tokens, r)
        past = DynamicCache()  # the cached positions before first, as views: the forward's update concatenates
        for i, layer in enumerate(parallel.cache.layers):
            past.update(layer.keys[:, :, :first], layer.values[:, :, :first], i)
        with learner.applied(), attention_tap(model, ScalingTap(parallel.spec)):
            logits = cached_forward(model, ids[None], past, position_ids=positions[None], attention_mask=mask).logits[0]
        return distillation_loss(logits.float(), laws[index]).mean()


def learning(proposer) -> OnlineProposer | None:
    """The :class:`OnlineProposer` in ``proposer`` (itself, or inside a copy pointer), None in a frozen one."""
    while proposer is not None and not isinstance(proposer, OnlineProposer):
        proposer = getattr(proposer, "inner", None)
    return proposer


# ----------------------------------------------------------------------------------------------
# Peak memory of a pass
# ----------------------------------------------------------------------------------------------

class PeakMemory:
    """The peak memory while the ``with`` block runs, in bytes (``peak``), and how it was read (``method``).

    CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``. CPU (Linux): the
    process's peak resident set ``VmHWM`` after resetting it (``/proc/self/clear_refs``, 5) and
    returning freed heap to the system (glibc ``malloc_trim``), so memory an earlier pass freed
    does not count in this one; it includes all that is resident (the models), the same for every
    pass. ``peak`` is None where neither can be read.
    """

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self.peak: int | None = None
        self.method = "cuda max_memory_allocated" if self.cuda else "cpu peak resident set (VmHWM, reset per pass)"

    def __enter__(self) -> "PeakMemory":
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return self
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass  # not glibc: freed heap may stay resident, and count
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.method = None
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = int(torch.cuda.max_memory_allocated())
        elif self.method is not None:
            self.peak = _vm_hwm()
            if self.peak is None:
                self.method = None


def _vm_hwm() -> int | None:
    """The process's peak resident set in bytes (``VmHWM`` of ``/proc/self/status``), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def tally_online(out: TeacherForced, edges: np.ndarray, meter=None, masks: dict | None = None
                 ) -> tuple[dict, np.ndarray]:
    """An online arm's per-bucket sums of one sequence, as :class:`~calibrate.measure.forced.Tally` holds
    them: ``({metric: (buckets,)}, mass (2, buckets))``; ``masks``: a recall sequence's row subsets
    (``calibrate.measure.forced.row_masks``)."""
    from .measure.forced import arm_sums

    n = out.n_visible.cpu().numpy()
    hits = (out.drafted[0] == out.target_next).cpu().numpy()
    accept = out.accept[0].double().cpu().numpy()
    mass = np.zeros((2, len(edges))) if meter is None else np.stack((meter.sums, meter.counts))
    return arm_sums(edges, n, hits, accept, masks or {}), mass
