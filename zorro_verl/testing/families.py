"""Every causal-LM architecture of the pinned transformers, built tiny and offline, and what zorro does with each.

:data:`OUTCOMES` is the one table of record: ``model_type -> "exact" | "refused:<refusal key>" | "skipped:<reason>"``
for every entry of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``. ``tests/integrations/transformers/
test_all_families.py`` checks reality against it both ways (an ``exact`` family matches the per-row forward in fp64,
a ``refused`` one raises the registered message of :mod:`zorro_verl.refusals`, the table lists every architecture)
and the README's model counts are checked against :func:`counts`. To flip a family (e.g. once zorro handles a
state-space mixer), change its entry here and the test tells whether reality agrees.

:func:`tiny_family_config` shrinks the family's own config class generically (every size field found by name: 2
layers, hidden 32, 4 heads, vocab 128, ...; dropouts 0) plus the few per-family settings in :data:`OVERRIDES` that
its validation or its layer types need (hybrids get one layer of each type). transformers is imported inside the
functions only.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["OUTCOMES", "OVERRIDES", "SLOW", "tiny_family_config", "tiny_family_model", "counts", "outcome_kind",
           "markdown"]

#: Size fields by name (the family's own names included); ints only.
_SIZES = {
    "vocab_size": 128, "hidden_size": 32, "n_embd": 32, "d_model": 32, "embed_dim": 32, "n_embed": 32,
    "intermediate_size": 64, "n_inner": 64, "ffn_dim": 64, "d_ff": 64, "ffn_hidden_size": 64, "filter_size": 64,
    "decoder_ffn_dim": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "num_hidden_layers": 2, "n_layer": 2, "n_layers": 2, "num_layers": 2, "decoder_layers": 2, "encoder_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "decoder_attention_heads": 4, "num_heads": 4,
    "encoder_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "max_position_embeddings": 256, "n_positions": 256, "n_ctx": 256, "global_head_dim": 8,
    "vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 8,
    "sliding_window": 4,  # shorter than the test's rows, so every window cuts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2,
}

#: Per-family config keywords on top of the generic shrink (validation rules, layer types of hybrids).
_MLA = dict(kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_group=1,
            topk_group=1, num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1, num_key_value_heads=4)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8)
OVERRIDES: dict[str, dict] = {
    "deepseek_v2": _MLA,
    "deepseek_v3": _MLA,
    "bamba": dict(**_MAMBA2, attn_layer_indices=[1]),
    "falcon_h1": dict(**_MAMBA2, mamba_d_ssm=64),  # 4 Mamba-2 heads x 16 (the defaults: 128 heads, state 256)
    "zamba2": dict(n_mamba_heads=4, mamba_d_state=8),
    "zamba": dict(use_mamba_kernels=False),  # its default raises without mamba-ssm on CUDA
    "granitemoehybrid": dict(**_MAMBA2, layer_types=["mamba", "attention"]),
    "nemotron_h": dict(mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=1,
                       moe_shared_expert_intermediate_size=32),
    "gemma3n_text": dict(num_kv_shared_layers=0, vocab_size_per_layer_input=128, hidden_size_per_layer_input=8,
                         laurel_rank=4, intermediate_size=64, altup_num_inputs=2, activation_sparsity_pattern=None),
    "codegen": dict(rotary_dim=4),
    "gptj": dict(rotary_dim=4),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=4),
    "glm4_moe_lite": _MLA,
    # LFM2's checkpoints mix short-convolution and attention layers; the default config lists attention only
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "youtu": _MLA,
    "longcat_flash": dict(_MLA, ffn_hidden_size=64, expert_ffn_hidden_size=32, zero_expert_num=1),
    "mamba2": dict(num_heads=4, head_dim=16, n_groups=1, state_size=8, chunk_size=8),
    # DBRX's router reads ffn_hidden_size as its input width: equal to d_model here
    "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=32, hidden_size=32, moe_num_experts=4, moe_top_k=2)),
    "reformer": dict(axial_pos_embds_dim=[16, 16], axial_pos_shape=[16, 16]),
    "glm_moe_dsa": _MLA,
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  mamba_d_state=8, mamba_dt_rank=8),
    "dots1": dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2),
}

#: Families that take seconds each even tiny (torch gated delta rule / Mamba-2 scan in fp64; one short batch like all).
SLOW: frozenset = frozenset({"bamba", "nemotron_h", "roc_bert", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text",
                             "qwen3_5_text", "qwen3_next"})

#: model_type -> outcome (module docstring). Layer types zorro does not handle yet (DeepSeek-V4's compressed
#: attention) are ``refused:step.layer_types``: flip an entry to ``exact`` when zorro
#: handles its layer type, and the test checks it.
_DRAFTER = "skipped:a speculative-decoding drafter on its target model's hidden states (no vocabulary of its own)"
_AUDIO = "skipped:an audio decoder whose config needs text- and audio-encoder configs (an encoder-decoder shell)"
_TODO = "skipped:tiny config not worked out yet"

OUTCOMES: dict[str, str] = {
    "afmoe": "exact",
    "apertus": "exact",
    "arcee": "exact",
    "aria_text": "exact",
    "bamba": "exact",
    "bart": "refused:step.packed_row_reader",
    "bert": "exact",
    "bert-generation": "exact",
    "big_bird": "refused:step.no_attention_interface",
    "bigbird_pegasus": "refused:step.bidirectional",
    "biogpt": "exact",
    "bitnet": "exact",
    "blenderbot": "refused:step.packed_row_reader",
    "blenderbot-small": "refused:step.packed_row_reader",
    "bloom": "refused:step.no_attention_interface",
    "blt": _TODO + " (the byte latent transformer's patcher, local encoder / decoder and global sub-models)",
    "camembert": "refused:step.own_positions",
    "codegen": "refused:step.no_attention_interface",
    "cohere": "exact",
    "cohere2": "exact",
    "cohere2_moe": "exact",
    "cpmant": "refused:step.no_attention_interface",
    "ctrl": "refused:step.no_attention_interface",
    "cwm": "exact",
    "data2vec-text": "refused:step.own_positions",
    "dbrx": "exact",
    "deepseek_v2": "exact",
    "deepseek_v3": "exact",
    "deepseek_v4": "refused:step.layer_types",
    "diffllama": "refused:step.no_attention_interface",
    "doge": "refused:step.model_mask",
    "dots1": "exact",
    "electra": "exact",
    "emu3": "exact",
    "ernie": "exact",
    "ernie4_5": "exact",
    "ernie4_5_moe": "exact",
    "exaone4": "exact",
    "exaone_moe": "exact",
    "falcon": "refused:step.no_attention_interface",
    "falcon_h1": "exact",
    "falcon_mamba": "exact",
    "flex_olmo": "exact",
    "fuyu": "exact",
    "gemma": "exact",
    "gemma2": "exact",
    "gemma3": "exact",
    "gemma3_text": "exact",
    "gemma3n": "skipped:needs the timm package (its vision tower); its text model is `gemma3n_text`",
    "gemma3n_text": "exact",
    "gemma4": "refused:step.unknown_kwargs",
    "gemma4_assistant": _DRAFTER,
    "gemma4_text": "exact",
    "gemma4_unified": "refused:step.bidirectional",
    "gemma4_unified_assistant": _DRAFTER,
    "gemma4_unified_text": "refused:step.bidirectional",
    "git": "refused:step.mixer_bypasses",
    "glm": "exact",
    "glm4": "exact",
    "glm4_moe": "exact",
    "glm4_moe_lite": "exact",
    "glm_moe_dsa": "refused:step.model_mask",
    "got_ocr2": "refused:step.no_attention_interface",
    "gpt-sw3": "exact",
    "gpt2": "exact",
    "gpt_bigcode": "exact",
    "gpt_neo": "refused:step.no_attention_interface",
    "gpt_neox": "exact",
    "gpt_neox_japanese": "refused:step.no_attention_interface",
    "gpt_oss": "exact",
    "gptj": "refused:step.no_attention_interface",
    "granite": "exact",
    "granitemoe": "exact",
    "granitemoehybrid": "exact",
    "granitemoeshared": "exact",
    "helium": "exact",
    "hrm_text": "exact",
    "hunyuan_v1_dense": "exact",
    "hunyuan_v1_moe": "exact",
    "hy_v3": "exact",
    "hyperclovax": "exact",
    "jais2": "exact",
    "jamba": "exact",
    "jetmoe": "exact",
    "laguna": "exact",
    "lfm2": "exact",
    "lfm2_moe": "exact",
    "llama": "exact",
    "llama4": "exact",
    "llama4_text": "exact",
    "longcat_flash": "exact",
    "mamba": "exact",
    "mamba2": "exact",
    "marian": "refused:step.packed_row_reader",
    "mbart": "refused:step.packed_row_reader",
    "megatron-bert": "refused:step.no_attention_interface",
    "mellum": "exact",
    "minimax": "exact",
    "minimax_m2": "exact",
    "ministral": "exact",
    "ministral3": "exact",
    "mistral": "exact",
    "mixtral": "exact",
    "mllama": "exact",
    "modernbert-decoder": "exact",
    "moshi": "refused:step.no_attention_interface",
    "mpt": "refused:step.no_attention_interface",
    "musicgen": _AUDIO,
    "musicgen_melody": _AUDIO,
    "mvp": "refused:step.no_attention_interface",
    "nanochat": "exact",
    "nemotron": "refused:step.no_attention_interface",
    "nemotron_h": "exact",
    "olmo": "exact",
    "olmo2": "exact",
    "olmo3": "exact",
    "olmo_hybrid": "exact",
    "olmoe": "exact",
    "openai-gpt": "refused:step.mixer_bypasses",
    "opt": "exact",
    "pegasus": "refused:step.packed_row_reader",
    "persimmon": "exact",
    "phi": "exact",
    "phi3": "exact",
    "phi4_multimodal": "skipped:a vision- and audio-language model whose towers take minutes to build here, shrunk",
    "phimoe": "exact",
    "plbart": "refused:step.packed_row_reader",
    "prophetnet": "refused:step.no_attention_interface",
    "qwen2": "exact",
    "qwen2_moe": "exact",
    "qwen3": "exact",
    "qwen3_5": "exact",
    "qwen3_5_moe": "exact",
    "qwen3_5_moe_text": "exact",
    "qwen3_5_text": "exact",
    "qwen3_moe": "exact",
    "qwen3_next": "exact",
    "recurrent_gemma": "refused:step.no_attention_interface",
    "reformer": "refused:step.no_attention_interface",
    "rembert": "refused:step.no_attention_interface",
    "roberta": "refused:step.own_positions",
    "roberta-prelayernorm": "refused:step.own_positions",
    "roc_bert": "exact",
    "roformer": "refused:step.no_attention_interface",
    "rwkv": "refused:step.no_attention_interface",
    "seed_oss": "exact",
    "smollm3": "exact",
    "solar_open": "exact",
    "stablelm": "exact",
    "starcoder2": "exact",
    "trocr": "refused:step.no_attention_interface",
    "vaultgemma": "exact",
    "whisper": "refused:step.unknown_kwargs",
    "xglm": "refused:step.no_attention_interface",
    "xlm": "refused:step.no_attention_interface",
    "xlm-roberta": "refused:step.own_positions",
    "xlm-roberta-xl": "refused:step.own_positions",
    "xlnet": "refused:step.no_attention_interface",
    "xlstm": "refused:step.mixer_bypasses",
    "xmod": "refused:step.own_positions",
    "youtu": "exact",
    "zamba": "exact",
    "zamba2": "exact",
}


def outcome_kind(outcome: str) -> str:
    """``exact`` / ``refused`` / ``skipped`` of an :data:`OUTCOMES` value."""
    return outcome.split(":", 1)[0]


def counts() -> dict:
    """``{"exact": n, "refused": n, "skipped": n}`` over :data:`OUTCOMES`."""
    out = {"exact": 0, "refused": 0, "skipped": 0}
    for v in OUTCOMES.values():
        out[outcome_kind(v)] += 1
    return out


def _layer_pick(base) -> list | None:
    """Indices of the default config's layers to keep: the first layer of each distinct ``layer_types`` entry
    (padded to 2), or None without layer types."""
    types = getattr(base, "layer_types", None)
    if not isinstance(types, list) or not types:
        return None
    idx = sorted({t: i for i, t in reversed(list(enumerate(types)))}.values())
    for i in range(len(types)):
        if len(idx) >= 2:
            break
        if i not in idx:
            idx.append(i)
    return sorted(idx)


def _shrink(cls, extra: dict) -> dict:
    """Constructor keywords for a tiny ``cls``: every size field of its defaults found in :data:`_SIZES` (or via its
    ``attribute_map``), every float dropout and router jitter 0 (as RL training runs), the first layer of each layer
    type (every per-layer list cut alike), a ``text_config`` / ``vision_config`` shrunk the same way, then ``extra``."""
    base = cls()
    amap = {v: k for k, v in (getattr(cls, "attribute_map", None) or {}).items()}
    n_layers = getattr(base, "num_hidden_layers", None)
    pick = _layer_pick(base)
    kw = {}
    for name, val in vars(base).items():
        std = amap.get(name, name)
        if std in _SIZES and (isinstance(val, int) and not isinstance(val, bool)
                              or val is None and std in ("head_dim", "num_key_value_heads")):
            kw[name] = _SIZES[std]
        elif ("dropout" in name or "pdrop" in name or name.endswith("_drop") or "jitter" in name) \
                and isinstance(val, float):
            kw[name] = 0.0
        elif pick is not None and isinstance(val, list) and len(val) == n_layers and not name.startswith("_"):
            kw[name] = [val[i] for i in pick]
    if pick is not None:  # the layer count field (some configs derive it from the per-layer list instead)
        kw.update({k: len(pick) for k in vars(base) if amap.get(k, k) == "num_hidden_layers"})
    for sub in ("text_config", "vision_config"):
        cfg = getattr(base, sub, None)
        if cfg is not None and hasattr(cfg, "to_dict") and type(cfg) is not cls:
            kw[sub] = _shrink(type(cfg), extra.pop(sub, {}))
    for tok in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        if isinstance(getattr(base, tok, None), int):
            kw[tok] = {"pad_token_id": 0, "bos_token_id": 1}.get(tok, 2)
    if hasattr(base, "tie_word_embeddings"):
        kw["tie_word_embeddings"] = False
    if hasattr(base, "is_decoder"):
        kw["is_decoder"] = True  # BERT-style encoders are causal LMs only as decoders
    kw.update(extra)
    return kw


def tiny_family_config(model_type: str):
    """A tiny config of ``model_type`` (a key of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), built offline."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    return cls(**_shrink(cls, OVERRIDES.get(model_type, {})))


#: Per-family steps after building (the model needs a setting its config does not hold).
_AFTER_BUILD = {"xmod": lambda model: model.set_default_language("en_XX")}


def tiny_family_model(model_type: str, *, seed: int = 0, attn_implementation: str = "eager"):
    """A randomly initialised fp64 ``*ForCausalLM`` of :func:`tiny_family_config` (every parameter and buffer fp64,
    1-D parameters offset so each matters), deterministic per ``seed``. Run it under
    :class:`~zorro_verl.testing.fp64.KeepFp64` for fp64-exact comparisons."""
    from zorro_verl.testing.fp64 import to_fp64
    from zorro_verl.testing.models import _perturb_vectors, model_from_config

    cfg = tiny_family_config(model_type)
    for c in {id(cfg): cfg, id(cfg.get_text_config()): cfg.get_text_config()}.values():
        c._experts_implementation = "eager"  # grouped_mm has no fp64 kernel
    model = to_fp64(model_from_config(cfg, torch.float64, seed, attn_implementation))
    _perturb_vectors(model)
    _AFTER_BUILD.get(model_type, lambda m: None)(model)
    return model


def markdown() -> str:
    """The text of ``docs/families.md``: every architecture and its outcome, grouped, with the refusals' settings
    (``python -m zorro_verl.testing.families > docs/families.md``)."""
    from zorro_verl.refusals import REFUSALS

    setting = {r.key: r.setting for r in REFUSALS}
    c = counts()
    out = ["# Every causal-LM architecture of transformers 5.10.4, and what zorro does with it", "",
           "Generated from `zorro_verl/testing/families.py` (`python -m zorro_verl.testing.families > "
           "docs/families.md`); `tests/integrations/transformers/test_all_families.py` builds each architecture "
           "tiny (fp64, 2 layers, vocab 128; hybrids one layer of each type) and checks it against this table both "
           "ways, on text-only GRPO batches (images and videos: the README's model table): *exact* = zorro's "
           "log-probs, entropy and loss within 1e-9 and every gradient within 1e-8 (relative) of the family's own "
           "forward of each row alone; *refused* = install or the step raises the "
           "message of that [refusal](refusals.md); *skipped* = not built here, for the reason given.", "",
           f"{len(OUTCOMES)} architectures: {c['exact']} exact, {c['refused']} refused with the reason, "
           f"{c['skipped']} skipped.", ""]
    for kind in ("exact", "refused", "skipped"):
        rows = sorted((mt, v.partition(":")[2]) for mt, v in OUTCOMES.items() if outcome_kind(v) == kind)
        out += [f"## {kind} ({len(rows)})", ""]
        if kind == "exact":
            out += [", ".join(f"`{mt}`" for mt, _ in rows), ""]
            continue
        out += ["| architecture | " + ("refused: setting" if kind == "refused" else "why skipped") + " |", "|---|---|"]
        for mt, rest in rows:
            out.append(f"| `{mt}` | {setting.get(rest, rest) if kind == 'refused' else rest} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(markdown())
