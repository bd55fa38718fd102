"""Cost of the SharpDraft runtime: attention and a SmolLM2 forward, with and without it.

Run ``python benchmarks/bench_runtime.py`` (``--help`` for options). It prints one table and writes
nothing. Every case uses a spec that is active (``n_ref = 256 < n``), so the runtime really scales:
log-linear (slope 0.16) by default; ``--law tabulated`` a table with knots every half octave up to
64 n_ref (the shape ``sharpdraft calibrate --law tabulated`` writes); ``--granularity head`` one
slope or table per head of SmolLM2's 30 x 9. Running both laws at one granularity compares their cost.

* Time: the two arms alternate call by call (A B B A ...) to cancel drift; the ratio is the median of
  per-pair ratios ``runtime / plain``.
* Peak memory: bytes allocated during one call above what was allocated before it; on CUDA from
  ``torch.cuda.max_memory_allocated``, on CPU from the PyTorch profiler's memory timeline (every
  tensor allocation and free inside the call); the smaller of two calls per arm, measured A B B A.
  ``delta`` is runtime minus plain.

Attention cases call transformers' ``sdpa_attention_forward`` directly and through
:func:`sharpdraft_runtime.sharpdraft_attention` with SmolLM2's attention shape (9 query heads,
3 key/value heads, head_dim 64) over ``n`` cached keys: ``q_len = 1`` is a decoding step (no mask),
``q_len = 16`` a draft block (a 4D mask, whose visible keys the runtime counts). Model cases run SmolLM2-135M: a prefill of 1024 tokens,
then a decoding step and a 16-token block over a 1024-token cache.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import os
import statistics
import time

# The CPU memory timeline comes from the PyTorch profiler, whose log lines would land between the table's
# rows; both settings are read once, so they are set before torch is imported (a value already in the
# environment wins). Kineto prints two "USDT:" lines (profiler_start, profiler_stop) per profiled call at
# every level below 6. The CPU allocator warns, in C++, that "Memory block of unknown size was allocated
# before the profiling started" when a call frees a tensor made before it (the KV cache a decoding step
# replaces): that free is not in the timeline, and peak_bytes counts only what the call allocates.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import numpy as np
import torch
from sharpdraft_theory import ScaleSpec
from sharpdraft_theory.spec import AlphaTable
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import sharpdraft_runtime as sr

LAWS = ("log-linear", "tabulated")


def bench_spec(law: str, granularity: str, layers: int = 30, heads: int = 9) -> ScaleSpec:
    """The benchmarked spec: slope 0.16 (per head: 0.16 (1 + h / 20)), or the same law tabulated at
    knots ``256 * 2^(j/2)`` up to 64 n_ref."""
    slopes = np.array(0.16) if granularity == "global" else np.tile(0.16 * (1 + np.arange(heads) / 20), (layers, 1))
    if law == "log-linear":
        return ScaleSpec(law=law, n_ref=256, slope=slopes.tolist(), top_k=4, granularity=granularity)
    knots = np.array([round(256 * 2 ** (j / 2)) for j in range(1, 13)])
    alpha = 1 + slopes[..., None] * np.log(knots / 256)
    return ScaleSpec(law=law, n_ref=256, slope=None, top_k=4, granularity=granularity,
                     table=AlphaTable(n=tuple(knots.tolist()), alpha=alpha.tolist()))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_bytes(fn, device: torch.device) -> int:
    """Peak bytes allocated while ``fn()`` runs, above those allocated when it starts."""
    if device.type == "cuda":
        sync(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - start
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        live += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peak = max(peak, live)
    return peak


def compare(plain, runtime, reps: int, device: torch.device, prepare=lambda: None) -> dict:
    """Interleaved timing and peak memory of two zero-argument callables; ``prepare()`` runs before each call."""
    for fn in (plain, runtime):  # warm-up: allocator caches, lazy initialisation
        prepare()
        fn()
    seconds = {plain: [], runtime: []}
    for rep in range(reps):
        for fn in ((plain, runtime) if rep % 2 == 0 else (runtime, plain)):
            prepare()
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            seconds[fn].append(time.perf_counter() - start)
    ratios = [r / p for p, r in zip(seconds[plain], seconds[runtime])]
    peaks = {plain: [], runtime: []}
    for fn in (plain, runtime, runtime, plain):  # A B B A: a one-off allocation cannot favour either arm
        prepare()
        peaks[fn].append(peak_bytes(fn, device))
    peak_plain, peak_runtime = min(peaks[plain]), min(peaks[runtime])
    return dict(plain_ms=1e3 * statistics.median(seconds[plain]), runtime_ms=1e3 * statistics.median(seconds[runtime]),
                ratio=statistics.median(ratios), peak_plain=peak_plain, delta=peak_runtime - peak_plain)


def attention_cases(spec: ScaleSpec, device: torch.device, dtype: torch.dtype, reps: int):
    """(name, result) for n in 1k, 4k, 16k and q_len in 1, 16."""
    config = LlamaConfig(vocab_size=8, hidden_size=576, intermediate_size=8, num_hidden_layers=1, num_attention_heads=9,
                         num_key_value_heads=3, attn_implementation="sdpa")
    model = sr.enable(LlamaForCausalLM(config).to(device, dtype).eval(), _layers(spec, 1))
    module = model.model.layers[0].self_attn
    gen = torch.Generator(device).manual_seed(0)
    for n in (1024, 4096, 16384):
        key, value = (torch.randn(1, 3, n, 64, generator=gen, device=device, dtype=dtype) for _ in range(2))
        for q_len in (1, 16):
            query = torch.randn(1, 9, q_len, 64, generator=gen, device=device, dtype=dtype)
            # What transformers' sdpa_mask builds: none for one token, lower-right causal for a block over a cache.
            mask = None if q_len == 1 else (torch.arange(n, device=device)[None, :]
                                            <= torch.arange(n - q_len, n, device=device)[:, None])[None, None]
            fresh = {}

            def prepare():
                fresh["query"] = query.clone()  # the runtime scales in place: every call gets the same input

            def plain():
                sdpa_attention_forward(module, fresh["query"], key, value, mask, scaling=0.125)

            def runtime():
                sr.sharpdraft_attention(module, fresh["query"], key, value, mask, scaling=0.125)

            with torch.inference_mode():
                yield f"attention n={n // 1024}k q_len={q_len}", compare(plain, runtime, reps, device, prepare)


def _layers(spec: ScaleSpec, layers: int) -> ScaleSpec:
    """``spec`` cut to its first ``layers`` layers (a global spec as it is)."""
    if spec.granularity == "global":
        return spec
    table = spec.table
    return dataclasses.replace(spec, slope=None if spec.slope is None else spec.slope[:layers],
                               table=None if table is None else dataclasses.replace(table, alpha=table.alpha[:layers]))


def model_cases(spec: ScaleSpec, device: torch.device, dtype: torch.dtype, reps: int):
    """(name, result) for SmolLM2-135M: prefill 1024 tokens, then 1 and 16 tokens over that cache."""
    from pydoc_data.topics import topics

    from calibrate.smollm2 import load_smollm2

    model, tokenizer = load_smollm2(device, dtype)
    plain_model, scaled_model = model, sr.enable(copy.deepcopy(model), spec)  # two arms, no switching in between
    ids = tokenizer("\n\n".join(topics.values()), return_tensors="pt").input_ids[:, :1040].to(device)
    context, more = ids[:, :1024], ids[:, 1024:]
    with torch.inference_mode():
        yield "SmolLM2 prefill 1024", compare(lambda: plain_model(context), lambda: scaled_model(context),
                                              max(3, reps // 4), device)
        caches = {}
        for arm in (plain_model, scaled_model):
            caches[arm] = DynamicCache(config=arm.config)
            arm(context, cache=caches[arm])
        for q_len in (1, 16):
            def prepare():
                for cache in caches.values():
                    cache.crop(1024 - cache.get_seq_length())  # drop what the last call added (crop takes -tokens)

            def step(arm, q_len=q_len):
                return lambda: arm(more[:, :q_len], cache=caches[arm])

            name = "decode 1" if q_len == 1 else f"block {q_len}"
            yield f"SmolLM2 {name} @1k", compare(step(plain_model), step(scaled_model), reps, device, prepare)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=20, help="timed calls per arm (prefill: a quarter, at least 3)")
    parser.add_argument("--skip-model", action="store_true", help="attention cases only (no SmolLM2)")
    parser.add_argument("--law", choices=LAWS, default="log-linear", help="the spec's law (see the docstring)")
    parser.add_argument("--granularity", choices=("global", "head"), default="global",
                        help="one slope (or table), or one per head")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads (1 by default: on a shared CPU, a stalled thread holds up the others)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    spec = bench_spec(args.law, args.granularity)
    shown = f"{spec.granularity} " + ("slopes" if spec.table is None else f"table of {len(spec.table.n)} knots")
    print(f"device {device}, {dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"spec: {spec.law} n_ref={spec.n_ref} {shown}")
    print(f"{'case':<28}{'plain ms':>10}{'runtime ms':>12}{'ratio':>8}{'peak plain B':>15}{'delta B':>10}")
    cases = attention_cases(spec, device, dtype, args.reps)
    if not args.skip_model:
        cases = itertools.chain(cases, model_cases(spec, device, dtype, args.reps))
    for name, r in cases:
        print(f"{name:<28}{r['plain_ms']:>10.3f}{r['runtime_ms']:>12.3f}{r['ratio']:>8.3f}{r['peak_plain']:>15,}"
              f"{r['delta']:>10,}", flush=True)


if __name__ == "__main__":
    main()
