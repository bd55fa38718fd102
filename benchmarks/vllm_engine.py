"""Run an exported folder (``sharpdraft export``) in vLLM offline and write what it did, as JSON.

Run with the engine's environment (``.venv-vllm/bin/python``, ``make vllm``) and, to apply a spec,
``SHARPDRAFT_SPEC`` set. ``tests/test_vllm.py`` and ``benchmarks/bench_vllm.py`` start it as a subprocess
(vLLM spawns processes: this file runs only under its ``__main__`` guard). Each prompt (a list of token
ids) is decoded greedily on its own, ``--new-tokens`` tokens (end of text ignored); per prompt the output
ids, the seconds of its ``generate`` call and the change of vLLM's ``spec_decode`` counters.
``--no-draft`` serves the target alone. ``--repeat R`` decodes the prompt list R times (timing rounds).
``--pair-plugin`` (with a spec): every round after the first decodes each prompt twice, once with the plugin's
drafter call and once with vLLM's own (switched in the worker between the two, in alternating order), so
that the plugin's cost is a ratio of paired calls under the same load (needs
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``: the switch is a function sent to the worker).
"""

import argparse
import functools
import json
import time


def _plugin(worker, on: bool) -> int:
    """In a vLLM worker: the drafter's attention through the plugin (``on``) or vLLM's own kernel; layers switched."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    switched = 0
    for layer in worker.vllm_config.compilation_config.static_forward_context.values():
        impl = getattr(layer, "impl", None)
        if getattr(impl, "_layer", None) is not None:  # a drafter layer the plugin has routed
            impl.forward = impl._drafter_forward if on else functools.partial(CPUAttentionBackendImpl.forward, impl)
            switched += 1
    return switched


def _counters(llm) -> dict:
    """vLLM's ``vllm:spec_decode_*`` counters: a number each, a list for the per-position vector."""
    out = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            out[metric.name] = list(metric.values) if hasattr(metric, "values") else metric.value
    return out


def _delta(after: dict, before: dict) -> dict:
    return {k: ([a - b for a, b in zip(v, before.get(k, [0] * len(v)))] if isinstance(v, list) else v - before.get(k, 0))
            for k, v in after.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", required=True, help="folder sharpdraft export wrote")
    parser.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--no-draft", action="store_true", help="the target alone (no speculative_config)")
    parser.add_argument("--pair-plugin", action="store_true", help="later rounds: each prompt with and without "
                                                                   "the plugin, paired")
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()
    with open(f"{args.export}/vllm.json", encoding="utf-8") as f:
        call = json.load(f)
    with open(args.prompts, encoding="utf-8") as f:
        prompts = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {} if args.no_draft else {"speculative_config": call["speculative_config"]}
    started = time.perf_counter()
    llm = LLM(model=call["model"], dtype=call["dtype"], max_model_len=call["max_model_len"], enforce_eager=True, disable_log_stats=False,
              seed=0, **kwargs)
    startup = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    runs = []
    for round_ in range(args.repeat):
        for i, ids in enumerate(prompts):
            switches = [None] if not args.pair_plugin or round_ == 0 else [(round_ + i) % 2 == 0, (round_ + i) % 2 == 1]
            for on in switches:
                if on is not None:
                    assert all(llm.collective_rpc(_plugin, args=(on,))), "no drafter layer routed by the plugin"
                before = _counters(llm)
                started = time.perf_counter()
                [result] = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
                seconds = time.perf_counter() - started
                runs.append({"round": round_, "prompt": i, "prompt_tokens": len(ids), "seconds": seconds,
                             "plugin": on, "output": list(result.outputs[0].token_ids),
                             "counters": _delta(_counters(llm), before)})
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"startup_seconds": startup, "runs": runs}, f)


if __name__ == "__main__":
    main()
