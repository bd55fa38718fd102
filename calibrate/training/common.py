"""What every trainer shares: the log line, ``--device``, atomic writes, the optimiser and its schedule,
one optimiser step, the running mean of the logged numbers, and the progress file a run resumes from.

Every file a trainer writes goes through ``sharpdraft_theory.atomic``: a temporary file beside it,
then one rename, so a stopped run leaves the old file or the new one, never half of one.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from sharpdraft_theory.atomic import atomic_path, atomic_write_text

__all__ = ["log", "check_device", "atomic_save", "atomic_text", "atomic_weights", "atomic_folder", "optimiser",
           "descend", "RunningMean", "save_progress", "resume"]

ROOT = Path(__file__).resolve().parents[2]  # the checkout: default folders live under its .cache/


def log(msg: str) -> None:
    """One line of a run's progress, stamped with the wall-clock time."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def check_device(name: str) -> torch.device:
    """``--device``: cpu, or cuda where a CUDA device is present; else a one-line exit."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise SystemExit(f"--device {name}: not a device; give cpu, or cuda on a GPU machine") from None
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device {name}: give cpu, or cuda on a GPU machine")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: no CUDA device here; give --device cpu")
    return device


def atomic_save(obj, path: Path) -> None:
    """``torch.save(obj, path)``, written whole or not at all."""
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


atomic_text = atomic_write_text  # (path, text): a config.json or a training log, whole or not at all


def atomic_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """``state`` as safetensors at ``path`` (metadata ``format: pt``), written whole or not at all."""
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})


@contextmanager
def atomic_folder(path: Path):
    """Yield an empty temporary folder beside ``path``; on success it replaces ``path`` whole (a reader
    never finds half a folder), on an error it is removed and ``path`` stays as it was."""
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def optimiser(params: list[torch.nn.Parameter], lr: float, steps: int):
    """AdamW (betas 0.9, 0.95, no weight decay) and its schedule over ``steps`` steps: a linear warmup
    over the first 5% (at least one step), then a cosine decay to 0. Returns (optimiser, scheduler)."""
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(s, steps) / steps)))
    return opt, sched


def descend(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, sched=None, loss: torch.Tensor | None = None,
            clip: float = 1.0) -> None:
    """One optimiser step: with ``loss``, the gradients cleared and ``loss`` backpropagated first (else the
    gradients ``params`` hold already); their norm clipped to ``clip``, the step, the schedule's (when given)."""
    if loss is not None:
        opt.zero_grad(set_to_none=True)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    if sched is not None:
        sched.step()


class RunningMean:
    """Exponential moving average of the numbers a log line shows (the loss, agreement per step): the
    first values as they are, then ``decay * mean + (1 - decay) * new``."""

    def __init__(self, decay: float):
        self.decay, self.values = decay, None

    def update(self, values: list[float]) -> list[float]:
        """Fold in ``values``; return the running means."""
        d = self.decay
        self.values = list(values) if self.values is None else [d * m + (1 - d) * x for m, x in zip(self.values, values)]
        return self.values

    def record(self, history: list[dict], step: int, loss: float, agreement: list[float], started: float) -> list[float]:
        """Append step ``step``'s record to ``history`` (its loss and agreement to 4 places, the seconds
        since ``started``) and fold ``[loss, *agreement]`` in; return the running means."""
        history.append({"step": step, "loss": round(loss, 4), "agreement": [round(a, 4) for a in agreement],
                        "seconds": round(time.time() - started, 1)})
        return self.update([loss, *agreement])


def save_progress(path: Path, settings: dict, parts: dict, gen: torch.Generator, history: list, step: int,
                  seconds: float) -> None:
    """The progress file: ``settings``, each of ``parts``' state dicts under its name (the model, ``opt``,
    ``sched``), the generator's state, the history, the steps done and the seconds spent; atomically."""
    atomic_save({"settings": settings, **{name: part.state_dict() for name, part in parts.items()},
                 "gen": gen.get_state(), "history": history, "step": step, "seconds": seconds}, path)


def resume(path: Path, settings: dict, parts: dict, gen: torch.Generator,
           defaults: dict | None = None) -> tuple[list, int, float]:
    """Load what :func:`save_progress` wrote at ``path`` into ``parts`` and ``gen``; return (history, steps
    done, seconds), or ([], 0, 0.0) when there is no such file. A file made with other ``settings``
    (``defaults``: the value an option had before it existed, for files older than it) is refused in
    one line."""
    if not path.is_file():
        return [], 0, 0.0
    state = torch.load(path, weights_only=False)
    if {**(defaults or {}), **state["settings"]} != settings:
        raise SystemExit(f"{path} was made with other options; delete it or use another --work")
    for name, part in parts.items():
        part.load_state_dict(state[name])  # a module already on its device: load_state_dict copies
    gen.set_state(state["gen"])
    return state["history"], state["step"], state["seconds"]
