"""Cost of the SharpDraft runtime: every deployable kind of spec against the unmodified drafter.

Run ``python benchmarks/bench_runtime.py`` (``--help`` for options). It prints one table and writes
nothing. Two drafters, as deployed: the demo EAGLE-3 head's drafting step (``calibrate/assets/
eagle3-smollm2``: the head's forward with the arguments ``Eagle3Proposer`` gives it, target
features from SmolLM2) and SmolLM2-135M itself as a drafter through :func:`sharpdraft_runtime.enable`.
Each case runs both arms over the same input: a prefill of 1,024 rows, a decoding step (one row over
a 1,024-row cache: the drafting step) and a block of 16 rows over that cache (the head's commit of
verified tokens, a draft block). The kinds are eval's variants at ``n_ref = 256`` (the demo head's
trained length), so every kind is active past 256 keys: ``spec`` (query scaling, log-linear slope
0.16 by default; ``--law tabulated`` a table with knots every half octave up to 64 n_ref, the shape
``sharpdraft calibrate --law tabulated`` writes; ``--granularity head`` one slope or table per head),
``window`` (W = 256), ``sinks`` (252 + 4), the distance fixes ``clamp`` (W = 255), ``group``
(W = 128, G from the longest length, 1,040) and ``pi``, and ``clamp+spec``.

* Time: the two arms alternate call by call (A B B A ...) to cancel drift; the ratio is the median of
  per-pair ratios ``runtime / plain``.
* Peak memory: bytes allocated during one call above what was allocated before it; on CUDA from
  ``torch.cuda.max_memory_allocated``, on CPU from the PyTorch profiler's memory timeline (every
  tensor allocation and free inside the call); the smaller of two calls per arm, measured A B B A.
  ``+peak`` is runtime minus plain. ``kept`` is the same for the bytes still allocated when the call
  returns, beyond what the call returns itself (both arms return the same shapes): persistent state.
* The attention call alone: a distance fix must re-rotate the far keys, ``O(n d)`` per layer and call,
  the order of the attention itself. Below the table, per drafter, one decoding step's attention call
  over the 1,024-key cache is timed alone, plain and with clamp (A B alternated) on the drafter's own
  path (``decode_attention``: the far keys rotated inside the logits' pass; SmolLM2's sdpa is plain
  attention, so ``enable`` takes it too), and turned into step ratios: what the clamp call's extra alone adds to the
  step, and what one more plain call per layer would (a rotated copy attended again costs about that).
"""

from __future__ import annotations

import argparse
import copy
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
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import sharpdraft_runtime as sr
from sharpdraft_runtime.positions import decode_attention
from calibrate.drafters.eagle3 import Eagle3Proposer, load
from calibrate.drafters.layers import attention, rope_inv_freq
from calibrate.drafters.target import hidden_state_features
from calibrate.eval.variants import variant_specs

LAWS = ("log-linear", "tabulated")
KINDS = ("spec", "window", "sinks", "clamp", "group", "pi", "clamp+spec")  # eval's variants a user deploys
N_REF, CONTEXT, BLOCK = 256, 1024, 16
CASES = ("prefill", "decode", "block")


def bench_spec(law: str, granularity: str, layers: int = 30, heads: int = 9) -> ScaleSpec:
    """The benchmarked scaling spec: slope 0.16 (per head: 0.16 (1 + h / 20)), or the same law tabulated at
    knots ``256 * 2^(j/2)`` up to 64 n_ref. ``layers`` and ``heads``: the drafter's."""
    slopes = np.array(0.16) if granularity == "global" else np.tile(0.16 * (1 + np.arange(heads) / 20), (layers, 1))
    if law == "log-linear":
        return ScaleSpec(law=law, n_ref=N_REF, slope=slopes.tolist(), top_k=4, granularity=granularity)
    knots = np.array([round(N_REF * 2 ** (j / 2)) for j in range(1, 13)])
    alpha = 1 + slopes[..., None] * np.log(knots / N_REF)
    return ScaleSpec(law=law, n_ref=N_REF, slope=None, top_k=4, granularity=granularity,
                     table=AlphaTable(n=tuple(knots.tolist()), alpha=alpha.tolist()))


def kind_specs(spec: ScaleSpec) -> dict[str, ScaleSpec]:
    """Each deployable kind's spec, as eval builds its variants (``calibrate.eval.variants.variant_specs``)."""
    return variant_specs(spec, N_REF, KINDS, longest=CONTEXT + BLOCK)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory(fn, device: torch.device) -> tuple[int, int]:
    """(peak, kept): bytes allocated at the peak of ``fn()`` and when it returns, above those allocated
    when it starts (``fn``'s result released first, so ``kept`` is what outlives the call besides it)."""
    if device.type == "cuda":
        sync(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        sync(device)
        peak = torch.cuda.max_memory_allocated(device) - start
        del result
        return peak, torch.cuda.memory_allocated(device) - start
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        result = fn()
        del result
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        live += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peak = max(peak, live)
    return peak, live


def compare(plain, runtime, reps: int, device: torch.device, prepare=lambda: None) -> dict:
    """Interleaved timing and memory of two zero-argument callables; ``prepare()`` runs before each call."""
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
    used = {plain: [], runtime: []}
    for fn in (plain, runtime, runtime, plain):  # A B B A: a one-off allocation cannot favour either arm
        prepare()
        used[fn].append(memory(fn, device))
    (peak_plain, kept_plain), (peak_runtime, kept_runtime) = (min(used[fn]) for fn in (plain, runtime))
    return dict(plain_ms=1e3 * statistics.median(seconds[plain]), ratio=statistics.median(ratios),
                peak=peak_runtime - peak_plain, kept=kept_runtime - kept_plain)


def eagle3_cases(drafter, ids: torch.Tensor, law: str, granularity: str, reps: int, device: torch.device,
                 cases=CASES):
    """(kind, case, result) for the demo head: prefill (``Eagle3Proposer.start``), a drafting step
    (one row, the head's own hidden state, over the cache), a block (a commit of 16 verified rows)."""
    head = drafter.head
    c = head.config
    features = hidden_state_features(drafter.target, ids, drafter.feature_ids)  # (1, T, 3H)
    context = head(ids[:, 1:CONTEXT + 1], features[:, :CONTEXT])
    past, hidden = context.past_key_values, context.hidden_states[:, -1:]
    after = torch.arange(CONTEXT, CONTEXT + BLOCK, device=device)[None]  # the rows after the cache
    specs = kind_specs(bench_spec(law, granularity, 1, c.num_attention_heads))

    def run(chain):
        arguments = dict(attention_hook=chain.hook, **chain.restriction)
        return {"prefill": lambda: head(ids[:, 1:CONTEXT + 1], features[:, :CONTEXT], **arguments),
                "decode": lambda: head(ids[:, CONTEXT + 1:CONTEXT + 2], hidden, position_ids=after[:, :1],
                                       past_key_values=past, **arguments),
                "block": lambda: head(ids[:, CONTEXT + 1:CONTEXT + BLOCK + 1], features[:, CONTEXT:CONTEXT + BLOCK],
                                      position_ids=after, past_key_values=past, **arguments)}

    plain = run(Eagle3Proposer(head, drafter.feature_ids, None))
    for kind, spec in specs.items():
        fixed = run(Eagle3Proposer(head, drafter.feature_ids, spec))
        for case in cases:
            yield kind, case, compare(plain[case], fixed[case], max(3, reps // 4) if case == "prefill" else reps,
                                      device)
    if "decode" not in cases:
        return
    query = torch.randn(1, c.num_attention_heads, 1, c.head_dim, device=device, dtype=past[0].dtype)
    scaling, inv_freq = head.midlayer.self_attn.scaling, rope_inv_freq(c.rotary_dim, c.rope_theta, c.rope_scaling,
                                                                      device)[0]
    kernel = lambda q, k, v: attention(q, k, v, scaling, None, "sdpa")  # noqa: E731
    cache = tuple(t.contiguous() for t in past)  # a step's cache is contiguous (its new row joined by torch.cat)
    yield "attention", "decode", compare(
        lambda: kernel(query, *cache),
        lambda: decode_attention(query, *cache, scaling, specs["clamp"].positions, inv_freq, kernel), reps, device)


def smollm2_cases(model, ids: torch.Tensor, law: str, granularity: str, reps: int, device: torch.device,
                  cases=CASES):
    """(kind, case, result) for SmolLM2 through ``enable``: prefill, one token and 16 over a 1,024-token cache."""
    text = model.config
    specs = kind_specs(bench_spec(law, granularity, text.num_hidden_layers, text.num_attention_heads))
    enabled = copy.deepcopy(model)  # the runtime's arm; the plain model stays untouched
    context, more = ids[:, :CONTEXT], ids[:, CONTEXT:]
    caches = {}
    for arm in (model, enabled):
        caches[arm] = DynamicCache(config=arm.config)
        arm(context, cache=caches[arm])  # the context at its true positions, the same in both arms

    def prepare():
        for cache in caches.values():
            cache.crop(CONTEXT - cache.get_seq_length())  # drop what the last call added (crop takes -tokens)

    def run(arm):
        return {"prefill": lambda: arm(context), "decode": lambda: arm(more[:, :1], cache=caches[arm]),
                "block": lambda: arm(more[:, :BLOCK], cache=caches[arm])}

    plain, fixed = run(model), run(enabled)
    for kind, spec in specs.items():
        sr.enable(enabled, spec)
        for case in cases:
            yield kind, case, compare(plain[case], fixed[case], max(3, reps // 4) if case == "prefill" else reps,
                                      device, prepare)
        sr.disable(enabled)
    if "decode" not in cases:
        return
    prepare()
    module = model.model.layers[0].self_attn
    key, value = (t.contiguous() for t in (caches[model].layers[0].keys, caches[model].layers[0].values))  # a step's are
    query = torch.randn(1, text.num_attention_heads, 1, key.shape[-1], device=device, dtype=key.dtype)
    inv_freq = model.model.rotary_emb.inv_freq
    kernel = lambda q, k, v: sdpa_attention_forward(module, q, k, v, None, scaling=module.scaling)[0]  # noqa: E731
    yield "attention", "decode", compare(
        lambda: kernel(query, key, value),
        lambda: decode_attention(query, key, value, module.scaling, specs["clamp"].positions, inv_freq, kernel),
        reps, device)


def report(name: str, layers: int, cases, shown=CASES) -> None:
    """Print the drafter's rows (one per kind, as soon as its cases are measured) and its attention line."""
    print(name, flush=True)
    rows, decode_ms = {}, []
    for kind, case, result in cases:
        if kind == "attention":  # the step's attention call alone, plain and with clamp, against the whole step
            step, plain = statistics.median(decode_ms), result["plain_ms"]
            extra = plain * (result["ratio"] - 1)
            print(f"  attention call alone (one row, {CONTEXT:,} keys): plain {plain:.3f} ms, clamp "
                  f"{result['ratio']:.2f}x (+{extra:.3f} ms); x {layers} layer(s) over the {step:.2f} ms step: "
                  f"clamp's call alone {1 + layers * extra / step:.3f}, one more plain call {1 + layers * plain / step:.3f}",
                  flush=True)
            continue
        rows.setdefault(kind, {})[case] = result
        if case == "decode":
            decode_ms.append(result["plain_ms"])
        r = rows[kind]
        if len(r) == len(shown):
            print(f"  {kind:<12}" + "".join(f"{r[c]['ratio']:>9.3f}" for c in shown)
                  + "".join(f"{r[c]['peak']:>15,}" for c in shown)
                  + f"{max((r[c]['kept'] for c in shown), key=abs):>8,}"
                  + "".join(f"{r[c]['plain_ms']:>11.2f}" for c in shown), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=20, help="timed calls per arm (prefill: a quarter, at least 3)")
    parser.add_argument("--drafters", default="eagle3,smollm2", help="comma-separated: eagle3 (the demo head), smollm2")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, of " + ", ".join(CASES))
    parser.add_argument("--law", choices=LAWS, default="log-linear", help="the scaling spec's law (see the docstring)")
    parser.add_argument("--granularity", choices=("global", "head"), default="global",
                        help="one slope (or table), or one per head")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads (1 by default: on a shared CPU, a stalled thread holds up the others)")
    args = parser.parse_args()
    drafters, cases = args.drafters.split(","), tuple(c for c in CASES if c in args.cases.split(","))
    if not drafters or any(d not in ("eagle3", "smollm2") for d in drafters):
        parser.error(f"--drafters {args.drafters}: give eagle3, smollm2 or both, comma-separated")
    if len(cases) != len(args.cases.split(",")):
        parser.error(f"--cases {args.cases}: give some of {', '.join(CASES)}, comma-separated, each once")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    from pydoc_data.topics import topics

    drafter = load("eagle3", None, None, device, dtype)  # the demo head and its target, SmolLM2
    model = drafter.target
    ids = drafter.tokenizer("\n\n".join(topics.values()), return_tensors="pt").input_ids[:, :CONTEXT + BLOCK + 1]
    ids = ids.to(device)
    print(f"device {device}, {dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"spec: {args.law} n_ref={N_REF} {args.granularity}; ratios runtime / plain, bytes runtime - plain")
    print(f"  {'kind':<12}" + "".join(f"{case:>9}" for case in cases)
          + "".join(f"{'+peak ' + case:>15}" for case in cases) + f"{'kept':>8}"
          + "".join(f"{case + ' ms':>11}" for case in cases))
    with torch.inference_mode():
        if "eagle3" in drafters:
            report("EAGLE-3 demo head (drafting step)", 1,
                   eagle3_cases(drafter, ids, args.law, args.granularity, args.reps, device, cases), cases)
        if "smollm2" in drafters:
            report("SmolLM2-135M through enable", model.config.num_hidden_layers,
                   smollm2_cases(model, ids, args.law, args.granularity, args.reps, device, cases), cases)


if __name__ == "__main__":
    main()
