"""Switching a Hugging Face model to zorro, and the one checked model call on a packed row (docs/design/model-step.md).

* :func:`install_zorro` sets the model's attention to the registered ``"zorro"`` function, wraps gated delta-net
  (``linear_attention``) layers of hybrid models (:mod:`.hybrid`), and — with ``probe`` — checks with a tiny forward
  that every decoder layer's sequence mixing goes through zorro. Any other layer type, or a model that does not
  dispatch through ``ALL_ATTENTION_FUNCTIONS``, raises here, never silently.
* :func:`forward_packed` is the only place a model runs on a packed row: it zeroes the step's counters, calls the
  root module (so FSDP hooks and any final processing run as in the stock forward) and checks that every attention
  and linear-attention layer ran through zorro exactly once.

Model-agnostic: nothing is patched by class name.
"""

from __future__ import annotations

import inspect
import re

import torch

from zorro_verl.integrations.transformers import hybrid, vision
from zorro_verl.integrations.transformers.attention import ZORRO_ATTN_NAME, register_zorro_attention
from zorro_verl.integrations.transformers.context import ACTIVE, LayerCalls, ModelMaskError, StepContext
from zorro_verl.integrations.transformers.lora import lora_unsupported
from zorro_verl.packing import build_plan

__all__ = ["install_zorro", "uninstall_zorro", "is_installed", "expected_layer_calls", "check_layer_calls",
           "forward_packed", "expected_windows", "check_windows", "probe_report"]

#: config.layer_types entries zorro handles: full and sliding-window attention (registered function) and linear
#: attention (hybrid.py).
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
_HANDLED_LAYER_TYPES = (*_ATTENTION_LAYER_TYPES, hybrid.LINEAR_ATTENTION)


def is_installed(model) -> bool:
    return getattr(model.config, "_attn_implementation", None) == ZORRO_ATTN_NAME


def expected_layer_calls(model) -> tuple[int, int]:
    """``(attention layers, linear-attention layers)`` one forward must run through zorro: the ``full_attention``
    and ``sliding_attention`` entries of ``config.layer_types`` when the config lists them, else
    ``num_hidden_layers``."""
    cfg = hybrid.text_config(model)
    n = getattr(cfg, "num_hidden_layers", None)
    if not isinstance(n, int):
        raise ValueError(f"model: cannot tell its decoder layer count (config.num_hidden_layers is {n!r}); zorro "
                         "supports decoder-only language models.")
    types = getattr(cfg, "layer_types", None)
    attn = sum(t in _ATTENTION_LAYER_TYPES for t in types[:n]) if types else n
    return attn, len(hybrid.linear_attention_modules(model))


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


#: Class names of modules that mix a sequence (attention, state-space / recurrent mixers, convolutions): used only to
#: *name* a module in a refusal, never to decide one.
_MIXER_NAME = re.compile(r"attention|attn|mixer|mamba|ssm|recurren|rwkv|lstm|rnn|retention|conv", re.I)


def _is_mixer_name(name: str) -> bool:
    return bool(_MIXER_NAME.search(name)) and not name.endswith(("ForCausalLM", "Model", "LMHeadModel",
                                                                  "ForConditionalGeneration"))


def _mixer_modules(model, skip: set = frozenset()) -> list[str]:
    """Distinct class names, in model order (a vision / audio tower's last), of the modules that look like sequence
    mixers (:data:`_MIXER_NAME`), leaving out the modules whose ``id()`` is in ``skip`` and their ancestors and
    descendants."""
    names, inside = [], set()
    for m in model.modules():
        if id(m) in skip:
            inside.update(id(x) for x in m.modules())
    for _, m in model.named_modules():
        if id(m) in inside or any(id(x) in skip for x in m.modules()):
            continue
        name = type(m).__name__
        if type(m).__module__.startswith("torch."):  # torch's own layers (a vision tower's Conv2d) name nothing
            continue
        if _is_mixer_name(name) and name not in names:
            names.append(name)
    # a media tower's modules last: the text model's mixers are the ones a text forward runs
    return sorted(names, key=lambda n: bool(re.search(r"vision|visual|image|audio|speech", n, re.I)))


def _unpluggable_modules(model) -> list[str]:
    """Class names of the mixer-like modules whose source file fails transformers' own test for a pluggable
    attention (``PreTrainedModel._can_set_attn_implementation``, which reads the class's module file): the ones that
    made transformers decline ``attn_implementation="zorro"``. Empty when that test is unavailable."""
    from transformers import PreTrainedModel

    check = getattr(PreTrainedModel._can_set_attn_implementation, "__func__", None)
    if check is None:
        return []
    names = []
    for m in model.modules():
        name = type(m).__name__
        if _is_mixer_name(name) and not type(m).__module__.startswith("torch.") and name not in names:
            try:
                if not check(type(m)):
                    names.append(name)
            except Exception:  # only names a module in a message: never let it mask the refusal
                continue
    return names


def check_layer_calls(model, calls: LayerCalls) -> None:
    """After one forward: every full-attention layer called the zorro attention once, every linear-attention
    layer ran zorro's gated delta-net forward once, and every attention call got its layer type's window. Raises
    ``ValueError`` otherwise (a layer bypassed zorro, or the deduplicated result would differ from the ordinary
    one)."""
    attn, rec = expected_layer_calls(model)
    if calls.attention < attn:
        bypass = _mixer_modules(model, calls.callers)
        if bypass:
            raise ValueError(
                f"model: {attn} attention layers but the zorro attention was called {calls.attention} times: module "
                f"{bypass[0]} mixes the sequence without transformers' AttentionInterface (it computes its mixing "
                "itself), so over the packed row a response would see its siblings. zorro reaches only attention "
                "called through ALL_ATTENTION_FUNCTIONS (and the gated delta-nets it wraps); this model is not "
                "supported by zorro.")
    if calls.attention != attn:
        raise ValueError(
            f"model: {attn} attention layers but the zorro attention was called {calls.attention} times; some layers "
            "do not dispatch attention through transformers' ALL_ATTENTION_FUNCTIONS (or mix the sequence another "
            "way), so the deduplicated forward would be wrong. This model is not supported by zorro.")
    if calls.recurrent != rec:
        raise ValueError(
            f"model: {rec} linear-attention layers but zorro's gated delta-net forward ran {calls.recurrent} times; a "
            "linear-attention module was bypassed or replaced after install_zorro. Call install_zorro(model) again "
            "after changing the model.")
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
    token = ACTIVE.set(ctx)  # reaches attention layers whose decoder layer drops **kwargs (StableLM)
    try:
        out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=None, zorro_ctx=ctx,
                    use_cache=False, **ctx.media_inputs(), **model_kwargs)
    # this call passes no mask and zorro registers no mask function: a mask reaching attention is the model's own
    except ModelMaskError as e:
        raise ValueError(
            f"model: it hands its attention a mask it builds itself ({e.args[0].split(':')[0]} got an "
            "attention_mask although zorro_step passes none and zorro registers no mask function: a learned or "
            "content-dependent mask zorro cannot reproduce on the packed row). This model is not supported by "
            "zorro.") from e
    finally:
        ACTIVE.reset(token)
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
        return getattr(model, "zorro_features", None)
    if probe and not vision.is_multimodal(model):
        _check_default_positions(model)
    model._zorro_previous_attn = getattr(model.config, "_attn_implementation", None)
    model._zorro_previous_sub_attn = vision.sub_attention(model)
    model._zorro_previous_text_attn = getattr(getattr(model.config, "text_config", None), "_attn_implementation",
                                              None)
    # a vision-language model: its language model runs zorro, its vision tower keeps its own attention
    model.set_attn_implementation(vision.zorro_attention_request(model, ZORRO_ATTN_NAME))
    if not is_installed(model):  # transformers declined (it only warns): the model's attention is not pluggable
        mixers = _unpluggable_modules(model) or _mixer_modules(model)
        raise ValueError(
            "model: its attention does not dispatch through transformers' AttentionInterface (module "
            f"{mixers[0] if mixers else type(model).__name__} computes attention itself; transformers keeps "
            f"attn_implementation={model.config._attn_implementation!r} on {type(model).__name__}), so zorro cannot "
            "reach it. zorro runs models whose attention calls ALL_ATTENTION_FUNCTIONS (the README's model table); "
            "this model is not supported by zorro.")
    try:
        hybrid.wrap_linear_attention(model)
        report = _probe(model) if probe else None
        _check_position_ids(model)
    except Exception:
        uninstall_zorro(model)
        raise
    model.zorro_features = report
    return report


def _check_default_positions(model) -> None:
    """Refuse a model whose own numbering of a row's tokens is not ``0..L-1`` (RoBERTa-style embeddings start
    after the padding index and skip pad ids): zorro gives every row the positions ``0..L-1``. No-grad forwards of
    one 5-token row with the model's own attention, ``position_ids`` None (twice) vs ``arange(5)``: the latter must
    differ from the first by no more than the two identical calls differ from each other (0 on deterministic
    kernels; on a GPU, atomics in e.g. MoE scatters can make identical calls differ by rounding), times 10."""
    emb = model.get_input_embeddings()
    vocab = emb.weight.shape[0]
    ids = (torch.arange(5, device=emb.weight.device) % max(vocab - 1, 1) + 1)[None]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            own = model(input_ids=ids, use_cache=False).logits
            again = model(input_ids=ids, use_cache=False).logits
            pos = torch.arange(5, device=ids.device)[None]
            counted = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    finally:
        model.train(was_training)
    noise = (own - again).abs().max().item()
    if (own - counted).abs().max().item() > 10 * noise:
        raise ValueError(
            f"model: {type(model).__name__} numbers a row's tokens other than 0, 1, 2, ... when it is given no "
            "position_ids (e.g. RoBERTa-style embeddings start after the padding index), while zorro gives every row "
            "the positions 0..L-1; the two forwards would differ. This model is not supported by zorro.")


def _check_position_ids(model) -> None:
    """Refuse a model whose forward takes no ``position_ids``: it numbers the packed row's tokens 0..T-1 itself, so
    each response would sit at the wrong distance from its prompt (and its siblings)."""
    from transformers import PreTrainedModel

    # the transformers model itself, under any wrapper (PEFT, FSDP) whose forward passes keywords on
    hf = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if hf is None:
        return
    for mod in (hf, hf.base_model):
        params = inspect.signature(mod.forward).parameters
        named = [p for p in params.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        # a pass-through wrapper (``*args, **kwargs`` only, e.g. a decoder wrapper or a patched forward) tells
        # nothing; a forward that names its inputs but not position_ids drops them
        if named and "position_ids" not in params:
            raise ValueError(
                f"model: {type(mod).__name__}.forward takes no position_ids (it numbers the tokens of its input "
                "itself), so on the packed row each response would get the wrong positions. zorro needs a model "
                "whose forward takes position_ids; this model is not supported by zorro.")


def uninstall_zorro(model) -> None:
    """Restore the attention implementation (and linear-attention forwards) the model had before
    :func:`install_zorro`."""
    hybrid.unwrap_linear_attention(model)
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
            forward_packed(model, ctx, logits_to_keep=plan.logit_index)
    finally:
        model.train(was_training)
    return probe_report(model, ctx.calls)
