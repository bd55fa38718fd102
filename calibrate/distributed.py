"""Data-parallel calibration on torch.distributed: ranks, their devices, and what they exchange.

``torchrun`` (and Slurm through torchrun's rendezvous) starts one process per rank and sets
``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``; ``Ranks.from_environment``
reads them (no variables: one process, and every collective below is a no-op).

Layout: sequence ``i`` belongs to rank ``i mod WORLD_SIZE``. On CUDA the ``g`` GPUs a node's
process sees are split evenly among its ``LOCAL_WORLD_SIZE`` ranks: local rank ``l`` gets GPUs
``l k .. l k + k - 1`` with ``k = g // LOCAL_WORLD_SIZE`` (``k = 1``: GPU ``LOCAL_RANK``), and the
process is restricted to them (``CUDA_VISIBLE_DEVICES``) before CUDA starts, so ``cuda`` means
its first GPU, and a model spread with ``device_map="auto"`` (hf and pard drafters on several
GPUs) stays on the rank's own GPUs. NCCL connects CUDA ranks, gloo CPU ranks.

Statistics travel through the process group (``gather``), not through files: every rank keeps
its per-sequence partial files for ``--resume`` wherever its ``--out`` points, and rank 0
receives all sequences' rows (each with its distance profile, ``RowStats.distance``), so several
nodes need no shared filesystem. With one, a resumed run finds every saved sequence whatever the
world size; without one, a sequence saved on another node is collected again. A ``UserError`` on any rank is raised on every rank (``agree``), so
none waits for a rank that has given up; rank 0 prints it, naming the rank.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta

from .errors import UserError

__all__ = ["Ranks", "is_main_process"]

#: How long a rank waits for the others at a collective. Shards are within one sequence of each
#: other on a fresh run, but after ``--resume`` one rank may have all its sequences saved while
#: another has all of its own to collect; a failed rank ends the job through torchrun anyway.
COLLECTIVE_TIMEOUT = timedelta(hours=24)

_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def is_main_process() -> bool:
    """Whether this process is rank 0 (or not under torchrun): the one that prints."""
    return os.environ.get("RANK", "0") == "0"


@dataclass(frozen=True)
class Ranks:
    """Where this process stands among the calibration's processes."""

    rank: int  # this process, 0 .. world_size - 1
    world_size: int  # processes in the job
    local_rank: int  # this process on its node: which of the node's GPUs it takes
    local_world_size: int  # processes on this node

    @classmethod
    def from_environment(cls) -> "Ranks":
        """The torchrun variables, or one process when ``WORLD_SIZE`` is not set."""
        if "WORLD_SIZE" not in os.environ:
            return cls(rank=0, world_size=1, local_rank=0, local_world_size=1)
        try:
            values = {name: int(os.environ.get(name, os.environ["WORLD_SIZE"] if name == "LOCAL_WORLD_SIZE" else "0"))
                      for name in _ENV}
        except ValueError:
            shown = ", ".join(f"{name}={os.environ.get(name)!r}" for name in _ENV)
            raise UserError(f"torch.distributed variables are not integers ({shown}); launch with torchrun") from None
        ranks = cls(rank=values["RANK"], world_size=values["WORLD_SIZE"], local_rank=values["LOCAL_RANK"],
                    local_world_size=values["LOCAL_WORLD_SIZE"])
        if not (0 <= ranks.rank < ranks.world_size and 0 <= ranks.local_rank < ranks.local_world_size):
            raise UserError(f"RANK={ranks.rank}, LOCAL_RANK={ranks.local_rank} do not fit WORLD_SIZE="
                            f"{ranks.world_size}, LOCAL_WORLD_SIZE={ranks.local_world_size}; launch with torchrun")
        return ranks

    @property
    def main(self) -> bool:
        """Rank 0: it gathers the statistics, fits, writes the spec and prints."""
        return self.rank == 0

    def owns(self, seq: int) -> bool:
        """Whether sequence ``seq`` is this rank's: ``seq mod world_size == rank``."""
        return seq % self.world_size == self.rank

    def device_option(self, device: str) -> str:
        """``--device`` for this rank: CUDA restricted to the rank's GPUs (module docstring).

        Must run before CUDA starts in this process (it counts GPUs through NVML, as
        ``torch.cuda.device_count`` does until then).
        """
        if self.world_size == 1 or device == "cpu":
            return device
        if device not in ("auto", "cuda"):
            raise UserError(f"--device {device}: under torchrun each rank uses its own GPUs (LOCAL_RANK); "
                            "pass --device auto, cuda or cpu")
        import torch  # here, not at the top: the CLI asks is_main_process without loading torch

        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = [g for g in visible.split(",") if g.strip()] if visible is not None else \
            [str(g) for g in range(torch.cuda.device_count())]
        if not gpus:
            return device  # no GPU: auto is the CPU, cuda fails in resolve_device with its own message
        per_rank = len(gpus) // self.local_world_size
        if per_rank == 0:
            raise UserError(f"{self.local_world_size} ranks on this node but {len(gpus)} GPUs: launch at most "
                            f"{len(gpus)} processes per node (torchrun --nproc-per-node)")
        mine = gpus[self.local_rank * per_rank:(self.local_rank + 1) * per_rank]
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
        return device

    def check_device(self, device: torch.device) -> None:
        """After the device is resolved: the rank really sees only its own GPUs."""
        if self.world_size == 1 or device.type != "cuda":
            return
        import torch

        expected = len(os.environ["CUDA_VISIBLE_DEVICES"].split(","))
        if torch.cuda.device_count() != expected:
            raise UserError(f"rank {self.rank}: CUDA started before its GPUs were assigned (sees "
                            f"{torch.cuda.device_count()}, expected {expected}); run calibration in a fresh process")

    @contextlib.contextmanager
    def group(self, device: torch.device):
        """Join the process group for the block (NCCL on CUDA, gloo on CPU); nothing for one process."""
        if self.world_size == 1:
            yield self
            return
        import torch
        import torch.distributed as dist

        if device.type == "cuda":
            torch.cuda.set_device(device.index or 0)  # NCCL's object collectives use the current device
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=COLLECTIVE_TIMEOUT,
                                rank=self.rank, world_size=self.world_size)
        try:
            yield self
        except UserError:
            if not self.main:
                # Rank 0 reports the error. Wait for it to leave the group: torchrun ends the
                # job when a rank exits with an error, and this rank leaving first could stop
                # rank 0 before it prints.
                with contextlib.suppress(Exception):
                    dist.barrier()
            raise
        finally:
            dist.destroy_process_group()

    def agree(self, step):
        """Run ``step()`` here; if it raised ``UserError`` on any rank, raise one on every rank.

        Returns ``step()``'s value. Rank 0's message names the rank that failed first (by rank).
        """
        error = None
        try:
            value = step()
        except UserError as err:
            if self.world_size == 1:
                raise
            error, value = str(err), None
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        errors = [None] * self.world_size
        dist.all_gather_object(errors, error)
        failed = [(rank, message) for rank, message in enumerate(errors) if message is not None]
        if failed:
            rank, message = failed[0]
            raise UserError(message if rank == 0 else f"rank {rank}: {message}")
        return value

    def gather(self, value) -> list | None:
        """Every rank's ``value`` on rank 0, in rank order; None on the other ranks."""
        if self.world_size == 1:
            return [value]
        import torch.distributed as dist

        values = [None] * self.world_size if self.main else None
        dist.gather_object(value, values, dst=0)
        return values
