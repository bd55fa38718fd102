"""``sharpdraft eval``: does the spec recover the drafter at long context, and better than the alternatives?

* :mod:`.options`: ``EvalOptions``, everything the command takes, checked once before any model loads;
* :mod:`.flags`: the command's options as typer declares them (flag, type, help text);
* :mod:`.variants`: the variants compared (names, checks, the spec each runs under);
* :mod:`.run`: ``run_eval`` (load, evaluate, write) and ``evaluate`` (the measurement on loaded drafters);
* :mod:`.decode`: the speculative decoding runs, one prompt per sequence and bucket;
* :mod:`.report`: the tables the command prints.

The plot is ``calibrate.plots.eval``; the result's schema is in docs/eval.md.
"""
