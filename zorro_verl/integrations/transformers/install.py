"""Switching a Hugging Face model to zorro, and the one checked model call on a packed row (docs/design/model-step.md).

* :func:`install_zorro` sets the model's attention to the registered ``"zorro"`` function, wraps gated delta-net
  (``linear_attention``) layers of hybrid models (:mod:`.hybrid`), Mamba-2 (``mamba``) layers (:mod:`.ssm`), LFM2's
  short convs (``conv``) and MiniMax's lightning attention (:mod:`.mixers`), moves Llama 4's NoPE query temperature
  into zorro's attention (:mod:`.positions`), and — with ``probe`` — checks with a tiny forward that every decoder
  layer's sequence mixing goes through zorro and that every module's output on the packed row equals its output on
  each row alone. Any other layer type, a model that does not dispatch through ``ALL_ATTENTION_FUNCTIONS``, or a
  layer that reads the packed row (its length, packed indices, a mask over it), raises here, never silently.
* :func:`forward_packed` is the only place a model runs on a packed row: it zeroes the step's counters, calls the
  root module (so FSDP hooks and any final processing run as in the stock forward) and checks that every attention
  and linear-attention layer ran through zorro exactly once.

Model-agnostic: nothing is patched by class name.
"""

from __future__ import annotations

import inspect
import re
from contextlib import nullcontext

import torch

from zorro_verl.integrations.transformers import hybrid, mixers, positions, ssm, vision
from zorro_verl.integrations.transformers.attention import CHUNKED_ATTENTION, ZORRO_ATTN_NAME, register_zorro_attention
from zorro_verl.integrations.transformers.context import ACTIVE, LayerCalls, ModelMaskError, StepContext
from zorro_verl.integrations.transformers.lora import lora_unsupported
from zorro_verl.packing import build_plan

__all__ = ["install_zorro", "uninstall_zorro", "is_installed", "expected_layer_calls", "check_layer_calls",
           "forward_packed", "expected_windows", "expected_chunks", "check_windows", "probe_report", "PROBE_RTOL"]

#: config.layer_types entries zorro handles: full, sliding-window and chunked attention (registered function;
#: ``attention`` is the state-space hybrids' name for full attention), linear attention (gated delta-nets: hybrid.py;
#: MiniMax's lightning attention: mixers.py), Mamba-2 (ssm.py), LFM2's short convs (mixers.py) and the token-wise
#: MLP / MoE layers of Nemotron-H (no sequence mixing).
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", CHUNKED_ATTENTION, "attention")
_TOKENWISE_LAYER_TYPES = ("mlp", "moe")
_HANDLED_LAYER_TYPES = (*_ATTENTION_LAYER_TYPES, hybrid.LINEAR_ATTENTION, ssm.MAMBA, mixers.SHORT_CONV,
                        *_TOKENWISE_LAYER_TYPES, ssm.HYBRID)


def is_installed(model) -> bool:
    return getattr(model.config, "_attn_implementation", None) == ZORRO_ATTN_NAME


def expected_layer_calls(model) -> tuple[int, int]:
    """``(attention layers, recurrent layers)`` one forward must run through zorro: the attention entries of
    ``config.layer_types`` when the config lists them, else ``num_hidden_layers``; the recurrent ones are the
    ``linear_attention`` (gated delta-net, lightning attention), ``mamba`` (Mamba-2) and ``conv`` (LFM2) layers."""
    cfg = hybrid.text_config(model)
    n = getattr(cfg, "num_hidden_layers", None)
    if not isinstance(n, int):
        raise ValueError(f"model: cannot tell its decoder layer count (config.num_hidden_layers is {n!r}); zorro "
                         "supports decoder-only language models.")
    types = getattr(cfg, "layer_types", None)
    # a ``hybrid`` layer (Zamba2) runs one attention call (its shared block) and one Mamba-2 layer
    attn = sum(t in (*_ATTENTION_LAYER_TYPES, ssm.HYBRID) for t in types[:n]) if types else n
    return attn, (len(hybrid.linear_attention_modules(model)) + len(ssm.mamba_modules(model))
                  + len(mixers.short_conv_modules(model)) + len(mixers.lightning_modules(model)))


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
    mixers.check_mixers_supported(model)
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


def expected_chunks(model) -> dict:
    """``{layer_idx: chunk | None}`` of the attention layers: ``config.attention_chunk_size`` on
    ``chunked_attention`` layers (transformers' ``create_chunked_causal_mask``), None elsewhere; empty without
    ``config.layer_types``."""
    cfg = hybrid.text_config(model)
    types = getattr(cfg, "layer_types", None) or []
    chunk = getattr(cfg, "attention_chunk_size", None)
    return {i: (chunk if t == CHUNKED_ATTENTION else None) for i, t in enumerate(types[:cfg.num_hidden_layers])
            if t in _ATTENTION_LAYER_TYPES}


def check_windows(model, calls: LayerCalls) -> None:
    """Every attention call's window and chunk equal the ones its layer type gives (:func:`expected_windows`,
    :func:`expected_chunks`); raises ``ValueError`` otherwise — the ordinary forward's mask follows the layer types,
    zorro follows the call."""
    expect, chunks = expected_windows(model), expected_chunks(model)
    for i, (layer, window, *rest) in enumerate(calls.features):
        layer = i if layer is None else layer
        if layer in expect and window != expect[layer]:
            raise ValueError(f"model: attention layer {layer} passed sliding_window={window} but its layer type "
                             f"gives {expect[layer]} (config.layer_types / config.sliding_window); the ordinary "
                             "forward's mask and zorro would differ. This model is not supported by zorro.")
        chunk = rest[3] if len(rest) > 3 else None
        if layer in chunks and chunk != chunks[layer]:
            raise ValueError(f"model: attention layer {layer} ran with attention chunk {chunk} but its layer type "
                             f"gives {chunks[layer]} (config.layer_types / config.attention_chunk_size; zorro reads "
                             "the chunk from the attention module's config and layer_idx); the ordinary forward's "
                             "mask and zorro would differ. This model is not supported by zorro.")


def probe_report(model, calls: LayerCalls) -> dict:
    """What one forward's attention calls received, checked against the model's layer types.

    Returns ``{"attention_layers", "linear_attention_layers", "sliding_window" ({layer: window} of the windowed
    layers), "attention_chunk" ({layer: chunk} of the chunked layers), "sinks" (layers with sink logits),
    "attn_logit_softcapping" ({layer: cap}), "scaling" (sorted distinct values), "query_temperature" (names of the
    modules whose NoPE query temperature zorro applies from the plan's positions), "final_logit_softcapping"}``.
    Raises ``ValueError`` when a layer's window or chunk differs from the one its layer type gives (the ordinary
    forward's mask follows the layer types; zorro follows the call)."""
    check_windows(model, calls)
    windows, chunks, sinks, caps, scales = {}, {}, [], {}, set()
    for i, (layer, window, has_sinks, cap, scaling, chunk) in enumerate(calls.features):
        layer = i if layer is None else layer
        if window is not None:
            windows[layer] = window
        if chunk is not None:
            chunks[layer] = chunk
        if has_sinks:
            sinks.append(layer)
        if cap is not None:
            caps[layer] = cap
        scales.add(scaling)
    attn, rec = expected_layer_calls(model)
    return {"attention_layers": attn, "linear_attention_layers": rec, "sliding_window": windows,
            "attention_chunk": chunks, "sinks": sinks, "attn_logit_softcapping": caps, "scaling": sorted(scales),
            "query_temperature": [name for name, _ in positions.temperature_layers(model)],
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
            f"model: {rec} linear-attention / mamba / short-conv layers but zorro's recurrent forwards ran "
            f"{calls.recurrent} times; a linear-attention, Mamba or short-conv module was bypassed or replaced after "
            "install_zorro. Call install_zorro(model) again after changing the model.")
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
    # under SP a multimodal call runs the whole row up to the merged embeddings, the language model its slice
    sliced = (vision.sliced_language_model(model, ctx.shard) if ctx.media is not None and ctx.shard is not None
              else nullcontext())
    token = ACTIVE.set(ctx)  # reaches attention layers whose decoder layer drops **kwargs (StableLM)
    try:
        with sliced:
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
    """Switch ``model`` to zorro attention (idempotent) and, with ``probe``, verify it computes what the ordinary
    forward computes.

    The probe (:func:`_probe`) runs a tiny batch — three rows of 5, 7 and 7 tokens, two sharing a prompt — once
    through the model's ordinary forward row by row and once through zorro's packed row, no grad, recording every
    module's output; it raises ``ValueError`` (restoring the model's previous attention) when a layer bypasses zorro,
    its features disagree with its layer types, or a module's output on the packed row differs from its output on
    the rows alone (a layer reading the packed row's length, packed indices or a mask over it). Returns the probe's
    :func:`probe_report` (the model features it saw: windows, chunks, sinks, soft-caps, scalings), also kept as
    ``model.zorro_features``; None without the probe. Verl's engines install without the probe (it would call
    submodules outside the FSDP root's forward) and rely on the check of every :func:`forward_packed`.
    """
    register_zorro_attention()
    _check_layer_types(model)
    if is_installed(model):
        positions.fix_query_temperature(model)  # idempotent
        hybrid.wrap_linear_attention(model)  # idempotent
        ssm.wrap_mamba(model)
        mixers.wrap_mixers(model)
        return getattr(model, "zorro_features", None)
    if probe and not vision.is_multimodal(model):
        _check_default_positions(model)
    model._zorro_previous_attn = getattr(model.config, "_attn_implementation", None)
    model._zorro_previous_sub_attn = vision.sub_attention(model)
    model._zorro_previous_text_attn = getattr(getattr(model.config, "text_config", None), "_attn_implementation",
                                              None)
    batch = _probe_batch(model) if probe else None
    reference = None
    if probe:
        try:
            reference = _probe_reference(model, batch)
        finally:
            _restore_attention(model)
    # a vision-language model: its language model runs zorro, its vision tower keeps its own attention
    model.set_attn_implementation(vision.zorro_attention_request(model, ZORRO_ATTN_NAME))
    if not is_installed(model):  # transformers declined (it only warns): the model's attention is not pluggable
        names = _unpluggable_modules(model) or _mixer_modules(model)
        raise ValueError(
            "model: its attention does not dispatch through transformers' AttentionInterface (module "
            f"{names[0] if names else type(model).__name__} computes attention itself; transformers keeps "
            f"attn_implementation={model.config._attn_implementation!r} on {type(model).__name__}), so zorro cannot "
            "reach it. zorro runs models whose attention calls ALL_ATTENTION_FUNCTIONS (the README's model table); "
            "this model is not supported by zorro.")
    try:
        positions.fix_query_temperature(model)
        hybrid.wrap_linear_attention(model)
        ssm.wrap_mamba(model)
        mixers.wrap_mixers(model)
        report = _probe(model, batch, reference) if probe else None
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


def uninstall_zorro(model) -> None:
    """Restore the attention implementation (and linear-attention forwards, and the modules' own query
    temperature) the model had before :func:`install_zorro`."""
    hybrid.unwrap_linear_attention(model)
    ssm.unwrap_mamba(model)
    positions.restore_query_temperature(model)
    mixers.unwrap_mixers(model)
    if is_installed(model):
        _restore_attention(model)


def _restore_attention(model) -> None:
    previous = getattr(model, "_zorro_previous_attn", None) or "sdpa"
    subs = getattr(model, "_zorro_previous_sub_attn", None) or {}
    if subs:  # a vision-language model: install switched its language model (text_config) too
        text = getattr(model, "_zorro_previous_text_attn", None) or previous
        model.set_attn_implementation({"": previous, "text_config": text, **subs})
    else:
        model.set_attn_implementation(previous)


#: The probe's tolerance on ``max|packed - row| / max(1, max|row|)`` per module output, by the model's dtype. The two
#: sides are the same math in a different order (split attention vs each row's own; the reference attention may be
#: transformers' eager, whose softmax some families take in fp32: ~1e-7 relative), so a correct model stays at
#: rounding: fp64 ~1e-15 (1e-7 with an fp32 softmax), fp32 ~1e-6, bf16/fp16 a few units of their 2^-8 / 2^-11
#: spacing. A layer that reads the packed row (a response seeing a sibling, a per-position quantity read at the packed
#: index) moves its output by a visible fraction of its scale on this batch — Llama 4's query temperature, unfixed,
#: by 6e-3 at floor_scale = 2 on the tiny test model. In half precision only such gross differences are caught.
PROBE_RTOL = {torch.float64: 1e-6, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}


def _probe_batch(model) -> dict:
    """Three rows ``[prompt A (3) | 2]``, ``[prompt A | 4]``, ``[prompt B (4) | 3]`` (lengths 5, 7, 7; packed row
    16 tokens: the second response and prompt B sit at packed indices past their row positions), verl's layout
    (left-padded prompts, right-padded responses)."""
    emb = model.get_input_embeddings()
    dev, vocab = emb.weight.device, emb.weight.shape[0]
    tok = lambda n, at: torch.arange(at, at + n, device=dev) % max(vocab - 1, 1) + 1  # noqa: E731
    Pw, R = 4, 4
    ids = torch.zeros(3, Pw + R, dtype=torch.long, device=dev)
    mask = torch.zeros_like(ids)
    a, b = tok(3, 0), tok(4, 5)
    for row, (prompt, r, at) in enumerate(((a, 2, 11), (a, 4, 15), (b, 3, 21))):
        ids[row, Pw - len(prompt):Pw], mask[row, Pw - len(prompt):Pw] = prompt, 1
        ids[row, Pw:Pw + r], mask[row, Pw:Pw + r] = tok(r, at), 1
    return {"plan": build_plan(ids, mask, R), "rows": [ids[i][mask[i].bool()] for i in range(3)]}


class _Recorder:
    """Forward hooks on every submodule: the first tensor output of each call whose dims are ``[1, seq_len, ...]``
    (the sequence axis second), detached, per module name in firing order."""

    def __init__(self, model):
        self.model, self.seq_len, self.out, self.handles = model, None, {}, []

    def __enter__(self):
        for name, mod in self.model.named_modules():
            if name:
                self.handles.append(mod.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def _hook(self, name):
        def hook(mod, args, output):
            x = output[0] if isinstance(output, (tuple, list)) and output else output
            if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[0] == 1 and x.shape[1] == self.seq_len:
                self.out.setdefault(name, []).append(x.detach())
        return hook


def _eager_reference(model) -> str:
    """The attention the probe's per-row reference runs: the model's own unless it is a kernel path that may skip
    a feature (transformers' SDPA path drops Gemma 2's soft-cap; flash / flex): then transformers' eager one."""
    prev = getattr(model, "_zorro_previous_attn", None) or "sdpa"
    return "eager" if any(k in prev for k in ("sdpa", "flash", "flex", "paged")) else prev


def _probe_reference(model, batch) -> list:
    """Every row of the probe batch alone through the model's ordinary forward: ``[{module: [outputs]}]``."""
    model.set_attn_implementation(vision.zorro_attention_request(model, _eager_reference(model)))
    was_training = model.training
    model.eval()
    rows = []
    try:
        with torch.no_grad(), _Recorder(model) as rec:
            for ids in batch["rows"]:
                rec.seq_len, rec.out = ids.numel(), {}
                model(input_ids=ids[None], use_cache=False)
                rows.append(rec.out)
    finally:
        model.train(was_training)
    return rows


def _probe(model, batch, reference) -> dict:
    from zorro_verl.attention.standard import row_index

    plan = batch["plan"]
    was_training = model.training
    model.eval()
    ctx = StepContext(plan, "sdpa")
    try:
        with torch.no_grad(), _Recorder(model) as rec:
            rec.seq_len = plan.T
            # a *ForCausalLM takes logits_to_keep; a value model (*ForTokenClassification) would hand it on to
            # its layers as an unknown keyword, and its head is one output per token anyway
            keep = ({"logits_to_keep": plan.logit_index}
                    if "logits_to_keep" in inspect.signature(model.forward).parameters else {})
            forward_packed(model, ctx, **keep)
    finally:
        model.train(was_training)
    report = probe_report(model, ctx.calls)
    ri = row_index(plan)["row_index"]  # [B, Lmax]: packed index of each row position
    rtol = PROBE_RTOL.get(model.get_input_embeddings().weight.dtype, 5e-2)
    for name, packed in rec.out.items():
        for b, row in enumerate(reference):
            if len(row.get(name, ())) != len(packed):
                continue  # a module called differently by zorro's path (a wrapped delta-net's internals)
            idx = ri[b, :batch["rows"][b].numel()]
            for x, y in zip(packed, row[name]):
                x = x[0, idx]
                if x.shape != y[0].shape:
                    continue
                err = (x - y[0]).abs().max().item()
                scale = max(1.0, y.abs().max().item())
                if not err <= rtol * scale:
                    # the first module (in hook order: innermost first) whose output differs; its parent is named
                    # too (an attention function is no module: its difference first shows in the o_proj after it)
                    where = f"{name} ({type(model.get_submodule(name)).__name__}"
                    if "." in name:
                        parent = name.rsplit(".", 1)[0]
                        where += f", in {parent} ({type(model.get_submodule(parent)).__name__})"
                    raise ValueError(
                        f"model: install probe: module {where}) gives a different output on "
                        f"zorro's packed row than on each row alone (row {b}: max difference {err:.3g}, "
                        f"{err / scale:.3g} of its scale, tolerance {rtol:g} for {y.dtype}). The layer reads the "
                        "packed row — its length, packed token indices or a mask over it — instead of each token's own "
                        "row and position, so the deduplicated forward would train a different function. This model "
                        "is not supported by zorro (a half-precision model whose difference is rounding: install it "
                        "in fp32 to check).")
    return report
