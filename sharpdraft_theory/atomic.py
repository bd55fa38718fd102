"""Atomic file writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import os
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_path", "atomic_write_text"]


@contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ""):
    """Yield a temporary path next to ``path``; on success move it over ``path`` in one rename.

    The new file gets the permission bits of the file it replaces, else the umask's default
    (``0o666 & ~umask``), as a plain ``open(path, "w")`` would: not ``mkstemp``'s private 0600.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=f".tmp{suffix}", dir=target.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, _mode_for(target))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _mode_for(target: Path) -> int:
    """Permission bits for a new file at ``target``: those of the file there, else ``0o666 & ~umask``."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)  # reading the umask means setting it; put it straight back
        os.umask(umask)
        return 0o666 & ~umask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
