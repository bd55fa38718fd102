"""Every ``config.json`` field of every drafter format, classified once: read, known harmless, or refused.

A loader calls :func:`check_fields` before it reads anything: a field that is neither read nor
known harmless is refused by name (it could change what the drafter computes), and so is a field
classified as refused. The classes:

* ``read``: the loader applies it; ``tests/test_released_drafters.py`` holds it to a float64
  reference of the source project's math (some values of a read field are refused where it is read,
  e.g. ``hidden_act`` other than silu).
* ``harmless``: it cannot change the queries, keys or visible-key counts the taps see, nor the
  logits ``sharpdraft eval`` compares: serialisation fields, fields of the target's config copied
  over, training-only options, routing fields of layer kinds the drafter does not have. ``why``
  says which.
* ``refused``: it changes the computation in a way the loader does not implement.

Each entry names its public source. ``docs/drafters.md``'s field table is :func:`docs_table`'s
output (``python -m calibrate.drafters.fields`` prints it; a test keeps the two equal).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError

__all__ = ["Field", "FORMATS", "READ", "HARMLESS", "REFUSED", "check_fields", "docs_table"]

READ, HARMLESS, REFUSED = "read", "harmless", "refused"


@dataclass(frozen=True)
class Field:
    """How one ``config.json`` field is handled, and why."""

    status: str  # READ, HARMLESS or REFUSED
    why: str  # read: what it changes; harmless: why it cannot change q, k, n or the logits; refused: what it would change
    source: str  # the public code or configs it was classified from


# sources, named once
_HF = "transformers PretrainedConfig.to_dict (serialised for every model)"
_SF_CFG = "sgl-project/SpecForge configs/*.json"
_SF_EAGLE = "sgl-project/SpecForge specforge/modeling/draft/llama3_eagle.py"
_SF_DFLASH = "sgl-project/SpecForge specforge/modeling/draft/dflash.py, algorithms/common/dflash_family_model.py"
_SPEC = "vllm-project/speculators src/speculators/config.py, models/eagle3, models/dflash"
_SPEC_STRIP = "vllm-project/speculators src/speculators/config.py SpeculatorModelConfig.to_dict (class variables)"
_EAGLE = "SafeAILab/EAGLE eagle/model/cnets.py, eagle/traineagle3/config.json"
_ZLAB = "z-lab/dflash dflash/model.py"
_VLLM = "vllm-project/vllm model_executor/models/llama_eagle3.py, layers/rotary_embedding"
_PARD = "AMD-AGI/PARD pard/pard_infer.py, pard/pard2_infer.py"


def _harmless(why: str, source: str, *names: str) -> dict[str, Field]:
    return {name: Field(HARMLESS, why, source) for name in names}


_SERIALISATION = _harmless("serialisation record (identity, dtype, versions, cache flag, init scale): read by no forward "
                           "pass", _HF, "architectures", "model_type", "auto_map", "torch_dtype", "dtype",
                           "transformers_version", "use_cache", "initializer_range", "bos_token_id", "eos_token_id",
                           "pad_token_id")
_DROPOUT = _harmless("dropout, applied in training only", _HF, "attention_dropout")
# speculators < 0.8 wrote its config class variables into config.json; current versions strip them (to_dict)
_SPECULATORS_CLASS_VARS = _harmless(
    "class variable of speculators' config written by older versions: serialisation, read by no forward pass",
    _SPEC_STRIP, "has_no_defaults_at_init", "base_model_ep_plan", "base_model_tp_plan", "base_model_pp_plan",
    "keys_to_ignore_at_inference", "base_config_key", "sub_configs", "is_composition", "attribute_map", "_auto_class")
_SPECULATORS_RECORD = _harmless(
    "speculators' record of the algorithm, proposal methods and verifier; the drafter's forward reads none of it",
    _SPEC, "speculators_version", "speculators_config", "embed_requires_grad")
_ROPE = {
    "rope_theta": Field(READ, "RoPE base (default 10000)", _HF),
    "rope_scaling": Field(READ, "RoPE frequency scaling: linear, llama3, yarn computed; mrope, dynamic, longrope "
                                "refused", _HF),
    "rope_parameters": Field(READ, "transformers-5 spelling of rope_theta + rope_scaling (+ partial_rotary_factor)",
                             _HF),
    "partial_rotary_factor": Field(READ, "RoPE on the first int(head_dim * factor) dimensions (EAGLE-3, as vLLM and "
                                         "SGLang rotate them); refused for DFlash", _VLLM),
}
_SHAPE = {name: Field(READ, what, _HF) for name, what in (
    ("hidden_size", "width H"), ("num_attention_heads", "query heads"), ("num_key_value_heads", "key/value heads"),
    ("intermediate_size", "MLP width"), ("vocab_size", "the target's vocabulary"), ("head_dim", "width of one head"),
    ("rms_norm_eps", "RMSNorm epsilon"),
    ("hidden_act", "MLP activation: silu only, others refused"),
    ("attention_bias", "q/k/v/o biases"), ("mlp_bias", "MLP biases: false only"),
    ("max_position_embeddings", "the stated length: n_ref below 16384 for EAGLE and SpecForge heads (exclusive), "
                                "never for speculators or DFlash"),
    ("layer_types", "which layers use a sliding window"), ("sliding_window", "the window W of sliding layers"),
    ("use_sliding_window", "true without layer_types, or false with sliding layers, is refused (transformers would "
                           "reinterpret them)"),
)}
# fields of the target's config that SpecForge and speculators copy into a drafter's: each configures a part the
# drafter does not have
_TARGET_COPIES = {
    **_harmless("the target's model type, which SpecForge reads to load the target for training; the draft "
                "module is llama3_eagle whatever it says", _SF_CFG + "; " + _SF_EAGLE, "target_model_type"),
    **_harmless("MoE routing of the target's layers (every k-th layer sparse); the drafter's MLP is dense",
                _SF_CFG + " (qwen3-next, qwen3.5 heads)", "decoder_sparse_step"),
    **_harmless("which of the target's layers use its sliding window; the drafter's layer_types say which of its own "
                "do", _HF + " (Qwen2/Qwen3 configs)", "max_window_layers"),
    **_harmless("tensor-parallel split of the target's layers: how weights are sharded, not what is computed", _HF,
                "pretraining_tp"),
}

_EAGLE3 = {
    **_SERIALISATION, **_DROPOUT, **_SPECULATORS_CLASS_VARS, **_SPECULATORS_RECORD, **_ROPE, **_SHAPE,
    **_TARGET_COPIES,
    "pretraining_tp": Field(READ, "1 only (other values refused)", _HF),
    "num_hidden_layers": Field(READ, "1 only: one-layer heads", _EAGLE),
    "draft_vocab_size": Field(READ, "rows of lm_head, length of d2t", _EAGLE),
    "target_hidden_size": Field(READ, "width of each target feature", _SF_EAGLE),
    "tie_word_embeddings": Field(HARMLESS, "EAGLE-3 heads keep their own lm_head over the draft vocabulary "
                                           "(lm_head.weight is loaded); no engine ties it", _SF_EAGLE + "; " + _VLLM),
    "eagle_config": Field(READ, "SpecForge's section: eagle_aux_hidden_state_layer_ids (read as SGLang does), "
                                "use_aux_hidden_state (false refused)", _SF_CFG),
    "eagle_aux_hidden_state_layer_ids": Field(READ, "top level: the ids as vLLM reads them (hidden_states[id])",
                                              _VLLM + "; " + _SPEC),
    "use_aux_hidden_state": Field(HARMLESS, "true is what every EAGLE-3 head does; false only under eagle_config "
                                            "changes anything (refused there)", _SF_CFG),
    "norm_before_residual": Field(READ, "residual taken after hidden_norm", _VLLM),
    "norm_before_fc": Field(READ, "one RMSNorm over the concatenated features (input_norm)", _SPEC),
    "fc_norm": Field(READ, "EAGLE 3.1: one RMSNorm per feature before fc", _SF_EAGLE),
    "norm_output": Field(READ, "SpecForge: false drops the final norm before lm_head; speculators: the fed-back "
                               "state is norm(o_t)", _SF_EAGLE + "; " + _SPEC),
    "speculators_model_type": Field(READ, "eagle3 (dflash and dspark point to --drafter dflash)", _SPEC),
    "transformer_layer_config": Field(READ, "speculators: the decoder's shape (llama, or qwen3 with q/k norms)",
                                      _SPEC),
}

_DFLASH = {
    **_SERIALISATION, **_DROPOUT, **_SPECULATORS_CLASS_VARS, **_SPECULATORS_RECORD, **_ROPE, **_SHAPE,
    **_TARGET_COPIES,
    "partial_rotary_factor": Field(READ, "1 only: z-lab's Qwen3 rotary applies cos/sin to the whole head, so a "
                                         "partial factor has no reference to be tested against (refused)", _ZLAB),
    "num_hidden_layers": Field(READ, "drafter layers", _ZLAB),
    "tie_word_embeddings": Field(HARMLESS, "DFlash has no lm_head of its own: the target's is used", _ZLAB),
    "block_size": Field(READ, "anchor + block_size - 1 mask tokens", _ZLAB),
    "mask_token_id": Field(READ, "the mask token", _ZLAB),
    "target_layer_ids": Field(READ, "z-lab / SpecForge: layers whose output is read (hidden_states[id + 1])", _ZLAB),
    "num_target_layers": Field(READ, "checked against the target", _ZLAB),
    "target_hidden_size": Field(READ, "width of each target feature", _ZLAB),
    "input_embedding_scale": Field(READ, "block embeddings times this", _ZLAB),
    "is_causal": Field(READ, "false only: causal blocks refused", _ZLAB),
    "attention_mode": Field(READ, "gqa or mha (DFlash's attention); mla, kda refused", _SF_DFLASH),
    "dflash_config": Field(READ, "z-lab's section for the draft fields above", _ZLAB),
    "projector_type": Field(READ, "the value SpecForge requires of its DFlash-backbone variants: domino for "
                                  "DominoDraftModel, dspark for DSparkDraftModel (others refused)",
                            "sgl-project/SpecForge specforge/modeling/draft/dspark.py, domino.py"),
    **_harmless("SpecForge DSpark's Markov and confidence heads: they add to the logits after the DFlash attention "
                "(weights markov_head.*, confidence_head.*, not run)",
                "sgl-project/SpecForge specforge/modeling/draft/dspark.py", "markov_rank", "markov_head_type",
                "enable_confidence_head", "confidence_head_with_markov", "confidence_head_alpha"),
    **_harmless("SpecForge Domino's GRU logit correction: it adds to the logits after the DFlash attention "
                "(weights prefix_gru.*, embed_proj.*, not run)",
                "sgl-project/SpecForge specforge/modeling/draft/domino.py", "emb_dim", "gru_hidden_dim",
                "pure_draft_prefix_len", "shift_label"),
    # vLLM speculators' DFlash, beside transformer_layer_config
    "speculators_model_type": Field(READ, "dflash (dspark refused: its heads' weight names are unknown)", _SPEC),
    "transformer_layer_config": Field(READ, "speculators: the Qwen3 decoder's shape", _SPEC),
    "aux_hidden_state_layer_ids": Field(READ, "speculators: hidden-state indices already (z-lab's ids + 1)", _SPEC),
    "sliding_window_non_causal": Field(READ, "speculators' anchor-counted window: sliding layers refused", _SPEC),
    "draft_vocab_size": Field(READ, "z-lab layout (this toolkit's extension): draft from rows i + d2t[i] of the "
                                    "target's lm_head only; speculators: rows of its own lm_head, not run", _SPEC),
    **_harmless("training-time anchor sampling and proposal options of speculators; no forward pass reads them",
                _SPEC, "max_anchors", "sample_from_anchor"),
}

_PARD = {
    "pard_token": Field(HARMLESS, "the mask token PARD appends when drafting in parallel; a calibration pass over "
                                  "text appends none", _PARD),
    "spd_type": Field(READ, "pard: a plain causal LM; pard2 refused (see pard2)", _PARD),
    "pard2": Field(REFUSED, "PARD-2 adds a projection of the target's hidden states (pard2_target_layers, "
                            "target_proj) to the drafter's input embeddings; run as a causal LM that term is dropped",
                   _PARD),
    **{name: Field(REFUSED, "PARD-2's target-feature term (see pard2)", _PARD) for name in (
        "pard2_target_layers", "pard2_scale", "pard2_target_dim", "pard2_proj_bias")},
}

# format -> field -> classification. eagle3 and dflash cover every level of their layouts (top level,
# dflash_config, eagle_config, speculators' transformer_layer_config); pard only PARD's own additions
# (the rest of a PARD config is a causal LM's, read by transformers)
FORMATS: dict[str, dict[str, Field]] = {"eagle3": _EAGLE3, "dflash": _DFLASH, "pard": _PARD}
_NAMES = {"eagle3": "EAGLE-3", "dflash": "DFlash", "pard": "PARD"}


def check_fields(d: dict, fmt: str, where: str, prefix: str = "", *, strict: bool = True) -> None:
    """Refuse a field of ``d`` classified as refused for ``fmt``, or (``strict``) classified not at all.

    ``prefix`` names the section in messages (``"dflash_config."``). The message names the field and
    says what it would change, or that it is unknown, and what to do.
    """
    table = FORMATS[fmt]
    for name in sorted(d):
        rule = table.get(name)
        if rule is not None and rule.status == REFUSED:
            raise UserError(f"{where}: config.json field '{prefix}{name}' is not supported by the {_NAMES[fmt]} "
                            f"loader: {rule.why}")
        if rule is None and strict:
            raise UserError(f"{where}: config.json field '{prefix}{name}' is not understood by the {_NAMES[fmt]} "
                            f"loader and could change what the model computes; refusing rather than ignoring it")


def docs_table() -> str:
    """The Markdown table of every classified field, per format (the one in ``docs/drafters.md``)."""
    lines = ["| format | field | status | what it does, or why it cannot change q, k, n or the logits | source |",
             "|---|---|---|---|---|"]
    for fmt, table in FORMATS.items():
        for name in sorted(table, key=lambda n: ({READ: 0, HARMLESS: 1, REFUSED: 2}[table[n].status], n.lower())):
            rule = table[name]
            lines.append(f"| {fmt} | `{name}` | {rule.status} | {rule.why} | {rule.source} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(docs_table(), end="")
