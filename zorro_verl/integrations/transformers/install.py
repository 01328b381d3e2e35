"""Switching a Hugging Face model to zorro, and the one checked model call on a packed row (docs/design/model-step.md).

* :func:`install_zorro` sets the model's attention to the registered ``"zorro"`` function, wraps gated delta-net
  (``linear_attention``) layers of hybrid models (:mod:`.hybrid`) and Mamba-2 (``mamba``) layers (:mod:`.ssm`),
  and — with ``probe`` — checks with a tiny forward that every decoder layer's sequence mixing goes through zorro.
  Any other layer type, or a model that does not dispatch through ``ALL_ATTENTION_FUNCTIONS``, raises here, never
  silently.
* :func:`forward_packed` is the only place a model runs on a packed row: it zeroes the step's counters, calls the
  root module (so FSDP hooks and any final processing run as in the stock forward) and checks that every attention
  and linear-attention layer ran through zorro exactly once.

Model-agnostic: nothing is patched by class name.
"""

from __future__ import annotations

import inspect

import torch

from zorro_verl.integrations.transformers import hybrid, ssm, vision
from zorro_verl.integrations.transformers.attention import ZORRO_ATTN_NAME, register_zorro_attention
from zorro_verl.integrations.transformers.context import LayerCalls, StepContext
from zorro_verl.integrations.transformers.lora import lora_unsupported
from zorro_verl.packing import build_plan

__all__ = ["install_zorro", "uninstall_zorro", "is_installed", "expected_layer_calls", "check_layer_calls",
           "forward_packed", "expected_windows", "check_windows", "probe_report"]

#: config.layer_types entries zorro handles: full and sliding-window attention (registered function; ``attention`` is
#: the state-space hybrids' name for full attention), linear attention (hybrid.py), Mamba-2 (ssm.py) and the
#: token-wise MLP / MoE layers of Nemotron-H (no sequence mixing).
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "attention")
_TOKENWISE_LAYER_TYPES = ("mlp", "moe")
_HANDLED_LAYER_TYPES = (*_ATTENTION_LAYER_TYPES, hybrid.LINEAR_ATTENTION, ssm.MAMBA, *_TOKENWISE_LAYER_TYPES)


def is_installed(model) -> bool:
    return getattr(model.config, "_attn_implementation", None) == ZORRO_ATTN_NAME


def expected_layer_calls(model) -> tuple[int, int]:
    """``(attention layers, recurrent layers)`` one forward must run through zorro: the attention entries of
    ``config.layer_types`` when the config lists them, else ``num_hidden_layers``; the recurrent ones are the
    ``linear_attention`` (gated delta-net) and ``mamba`` (Mamba-2) layers."""
    cfg = hybrid.text_config(model)
    n = getattr(cfg, "num_hidden_layers", None)
    if not isinstance(n, int):
        raise ValueError(f"model: cannot tell its decoder layer count (config.num_hidden_layers is {n!r}); zorro "
                         "supports decoder-only language models.")
    types = getattr(cfg, "layer_types", None)
    attn = sum(t in _ATTENTION_LAYER_TYPES for t in types[:n]) if types else n
    return attn, len(hybrid.linear_attention_modules(model)) + len(ssm.mamba_modules(model))


def _check_layer_types(model) -> None:
    """Refuse (at install time) any layer type whose sequence mixing zorro does not handle."""
    types = getattr(hybrid.text_config(model), "layer_types", None)
    if types:
        other = sorted({t for t in types if t not in _HANDLED_LAYER_TYPES})
        if other:
            raise ValueError(
                f"model: layers of type {other} do not mix the sequence through zorro (only "
                f"{list(_HANDLED_LAYER_TYPES)} are handled). Running them over the packed row would let one response "
                "see its siblings — refused. Use a model whose layers are all of the handled types.")
    hybrid.check_linear_attention_supported(model)
    ssm.check_mamba_supported(model)
    cfg = hybrid.text_config(model)
    drop = getattr(cfg, "attention_dropout", 0.0) or 0.0
    if drop:
        raise ValueError(f"model: config.attention_dropout = {drop}; zorro's attention has no dropout (training-mode "
                         "dropout would also make the step's forwards differ). Set config.attention_dropout = 0 "
                         "(as RL training does) before install_zorro.")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError("model: config.use_bidirectional_attention = True; split attention is causal only. Use the "
                         "causal model.")
    reason = lora_unsupported(model)
    if reason is not None:
        raise ValueError(f"model: {reason} before install_zorro.")


def expected_windows(model) -> dict:
    """``{layer_idx: window | None}`` of the attention layers, as the model's ordinary masks apply them: from
    ``config.layer_types`` (``sliding_attention`` layers get ``config.sliding_window``), else one
    ``config.sliding_window`` for every layer (Mistral) unless ``use_sliding_window`` is False."""
    cfg = hybrid.text_config(model)
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types:
        return {i: (window if t == "sliding_attention" else None) for i, t in enumerate(types[:n])
                if t in _ATTENTION_LAYER_TYPES}
    if getattr(cfg, "use_sliding_window", True) is False:
        window = None
    return {i: window for i in range(n)}


def check_windows(model, calls: LayerCalls) -> None:
    """Every attention call's window equals the one its layer type gives (:func:`expected_windows`); raises
    ``ValueError`` otherwise — the ordinary forward's mask follows the layer types, zorro follows the call."""
    expect = expected_windows(model)
    for i, (layer, window, *_) in enumerate(calls.features):
        layer = i if layer is None else layer
        if layer in expect and window != expect[layer]:
            raise ValueError(f"model: attention layer {layer} passed sliding_window={window} but its layer type "
                             f"gives {expect[layer]} (config.layer_types / config.sliding_window); the ordinary "
                             "forward's mask and zorro would differ. This model is not supported by zorro.")


def probe_report(model, calls: LayerCalls) -> dict:
    """What one forward's attention calls received, checked against the model's layer types.

    Returns ``{"attention_layers", "linear_attention_layers", "sliding_window" ({layer: window} of the windowed
    layers), "sinks" (layers with sink logits), "attn_logit_softcapping" ({layer: cap}), "scaling" (sorted distinct
    values), "final_logit_softcapping"}``. Raises ``ValueError`` when a layer's window differs from the one its
    layer type gives (the ordinary forward's mask follows the layer types; zorro follows the call)."""
    check_windows(model, calls)
    windows, sinks, caps, scales = {}, [], {}, set()
    for i, (layer, window, has_sinks, cap, scaling) in enumerate(calls.features):
        layer = i if layer is None else layer
        if window is not None:
            windows[layer] = window
        if has_sinks:
            sinks.append(layer)
        if cap is not None:
            caps[layer] = cap
        scales.add(scaling)
    attn, rec = expected_layer_calls(model)
    return {"attention_layers": attn, "linear_attention_layers": rec, "sliding_window": windows, "sinks": sinks,
            "attn_logit_softcapping": caps, "scaling": sorted(scales),
            "final_logit_softcapping": getattr(hybrid.text_config(model), "final_logit_softcapping", None)}


def check_layer_calls(model, calls: LayerCalls) -> None:
    """After one forward: every full-attention layer called the zorro attention once, every linear-attention
    layer ran zorro's gated delta-net forward once, and every attention call got its layer type's window. Raises
    ``ValueError`` otherwise (a layer bypassed zorro, or the deduplicated result would differ from the ordinary
    one)."""
    attn, rec = expected_layer_calls(model)
    if calls.attention != attn:
        raise ValueError(
            f"model: {attn} attention layers but the zorro attention was called {calls.attention} times; some layers "
            "do not dispatch attention through transformers' ALL_ATTENTION_FUNCTIONS (or mix the sequence another "
            "way), so the deduplicated forward would be wrong. This model is not supported by zorro.")
    if calls.recurrent != rec:
        raise ValueError(
            f"model: {rec} linear-attention / mamba layers but zorro's recurrent forwards ran {calls.recurrent} "
            "times; a linear-attention or Mamba module was bypassed or replaced after install_zorro. Call "
            "install_zorro(model) again after changing the model.")
    check_windows(model, calls)


def forward_packed(model, ctx: StepContext, **model_kwargs):
    """Run ``model`` (the root ``*ForCausalLM``, possibly FSDP-wrapped) on ``ctx.plan``'s packed row (or, with
    ``ctx.shard``, on this rank's sequence-parallel slice of it).

    ``model_kwargs`` go to the model call (e.g. ``logits_to_keep``). Returns the model's output; raises if zorro
    is not installed or a layer bypassed it.
    """
    if not is_installed(model):
        raise ValueError("model: zorro is not installed on this model (its attn_implementation is "
                         f"{getattr(model.config, '_attn_implementation', None)!r}). Call install_zorro(model) "
                         "or DeduplicatedActor.patch() first.")
    ctx.calls.reset()
    input_ids, position_ids = ctx.model_inputs()
    if ctx.media is not None and not vision.is_multimodal(model):
        raise ValueError("media: this model has no vision tower (config.vision_config); multimodal inputs need a "
                         "vision-language model.")
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=None, zorro_ctx=ctx, use_cache=False,
                **ctx.media_inputs(), **model_kwargs)
    check_layer_calls(model, ctx.calls)
    return out


def install_zorro(model, *, probe: bool = True) -> dict | None:
    """Switch ``model`` to zorro attention (idempotent) and, with ``probe``, verify every layer dispatches to it.

    The probe is a no-grad forward of a 2-row, 1-group batch of a few tokens. Raises ``ValueError`` (restoring the
    model's previous attention) when a layer would bypass zorro or its features disagree with its layer types.
    Returns the probe's :func:`probe_report` (the model features it saw: windows, sinks, soft-caps, scalings), also
    kept as ``model.zorro_features``; None without the probe. Verl's engines install without the probe (it would
    call submodules outside the FSDP root's forward) and rely on the check of every :func:`forward_packed`.
    """
    register_zorro_attention()
    _check_layer_types(model)
    if is_installed(model):
        hybrid.wrap_linear_attention(model)  # idempotent
        ssm.wrap_mamba(model)
        return getattr(model, "zorro_features", None)
    model._zorro_previous_attn = getattr(model.config, "_attn_implementation", None)
    model._zorro_previous_sub_attn = vision.sub_attention(model)
    model._zorro_previous_text_attn = getattr(getattr(model.config, "text_config", None), "_attn_implementation",
                                              None)
    # a vision-language model: its language model runs zorro, its vision tower keeps its own attention
    model.set_attn_implementation(vision.zorro_attention_request(model, ZORRO_ATTN_NAME))
    try:
        hybrid.wrap_linear_attention(model)
        ssm.wrap_mamba(model)
        report = _probe(model) if probe else None
    except Exception:
        uninstall_zorro(model)
        raise
    model.zorro_features = report
    return report


def uninstall_zorro(model) -> None:
    """Restore the attention implementation (and linear-attention forwards) the model had before
    :func:`install_zorro`."""
    hybrid.unwrap_linear_attention(model)
    ssm.unwrap_mamba(model)
    if is_installed(model):
        previous = getattr(model, "_zorro_previous_attn", None) or "sdpa"
        subs = getattr(model, "_zorro_previous_sub_attn", None) or {}
        if subs:  # a vision-language model: install switched its language model (text_config) too
            text = getattr(model, "_zorro_previous_text_attn", None) or previous
            model.set_attn_implementation({"": previous, "text_config": text, **subs})
        else:
            model.set_attn_implementation(previous)


def _probe(model) -> None:
    emb = model.get_input_embeddings()
    vocab = emb.weight.shape[0]
    ids = (torch.arange(10, device=emb.weight.device) % max(vocab - 1, 1) + 1).view(2, 5)
    ids[:, :3] = ids[0, :3]  # one shared 3-token prompt, two 2-token responses
    plan = build_plan(ids, None, 2)
    was_training = model.training
    model.eval()
    ctx = StepContext(plan, "sdpa")
    try:
        with torch.no_grad():
            # a *ForCausalLM takes logits_to_keep; a value model (*ForTokenClassification) would hand it on to
            # its layers as an unknown keyword, and its head is one output per token anyway
            keep = ({"logits_to_keep": plan.logit_index}
                    if "logits_to_keep" in inspect.signature(model.forward).parameters else {})
            forward_packed(model, ctx, **keep)
    finally:
        model.train(was_training)
    return probe_report(model, ctx.calls)
