"""Hugging Face transformers integration: the registered ``"zorro"`` attention and the deduplicated model forward.

* :func:`register_zorro_attention` registers one function under ``"zorro"`` in ``AttentionInterface``
  (idempotent, never at import). No mask function is registered, so transformers passes ``attention_mask=None``
  and builds no O(T^2) mask.
* :func:`install_zorro` switches a model's attention to ``"zorro"`` and checks, with a tiny probe forward, that every
  decoder layer's sequence mixing goes through it. Gated delta-net (``linear_attention``) layers of hybrid models
  (Qwen3.5, Qwen3-Next) get per-instance forwards from :mod:`zorro_verl.integrations.hybrid`; any other layer type,
  or a model that does not dispatch through ``ALL_ATTENTION_FUNCTIONS``, raises here, never silently.
* :func:`zorro_forward` runs the decoder on the packed row with the plan as the ``zorro_plan`` kwarg and computes
  log-probs / entropy only at response-predicting rows.

Model-agnostic: nothing is patched by class name.
"""

from __future__ import annotations

from typing import Optional

import torch

from zorro_verl.attention import attend
from zorro_verl.integrations.transformers import hybrid
from zorro_verl.logprob import response_logprobs
from zorro_verl.packing import ZorroPlan, build_plan, require_plan

__all__ = [
    "ZORRO_ATTN_NAME",
    "register_zorro_attention",
    "zorro_attention_forward",
    "install_zorro",
    "uninstall_zorro",
    "is_installed",
    "zorro_forward",
    "backend_for",
    "reset_layer_calls",
    "check_layer_calls",
]

ZORRO_ATTN_NAME = "zorro"

#: config.layer_types entries zorro handles: full attention (registered function) and linear attention (hybrid.py).
_HANDLED_LAYER_TYPES = ("full_attention", hybrid.LINEAR_ATTENTION)

#: The API's ``attn_implementation`` names the kernel zorro uses inside its split attention.
_KERNEL_TO_BACKEND = {
    "eager": "eager",
    "sdpa": "sdpa",
    "flash_attention_2": "flash",
    "flash_attention_3": "flash",
    "flex_attention": "flex",
}


def backend_for(attn_implementation: str, use_split_attention: bool = True) -> str:
    """Map the API's ``attn_implementation`` (and ``use_split_attention``) to a plan backend name."""
    if attn_implementation not in _KERNEL_TO_BACKEND:
        raise ValueError(f"attn_implementation: expected one of {sorted(_KERNEL_TO_BACKEND)}, got "
                         f"{attn_implementation!r}.")
    if not use_split_attention:
        return "standard"
    return _KERNEL_TO_BACKEND[attn_implementation]


def zorro_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                            scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                            softcap: Optional[float] = None, zorro_plan: Optional[ZorroPlan] = None, **kwargs):
    """The attention function registered as ``"zorro"``.

    Args:
        query: ``[1, Hq, T, D]``; key/value: ``[1, Hkv, T, D]`` (RoPE / q-k-norm applied, GQA not expanded).
        attention_mask: must be ``None`` (zorro registers no mask function; the plan carries the structure).
        zorro_plan: the micro-batch's :class:`ZorroPlan`, passed as a kwarg of the model call.

    Returns:
        ``([1, T, Hq, D], None)``.
    """
    require_plan(zorro_plan, "zorro attention")
    if attention_mask is not None:
        raise ValueError("zorro attention: got an attention_mask; the model built a mask although zorro registers "
                         "none. Call the model without attention_mask (the plan carries the structure).")
    if query.dim() != 4 or query.shape[0] != 1 or query.shape[2] != zorro_plan.T:
        raise ValueError(f"zorro attention: expected query [1, Hq, T={zorro_plan.T}, D] (one packed row), got "
                         f"{tuple(query.shape)}. Pass input_ids=plan.input_ids[None].")
    if sliding_window is not None:
        raise ValueError(f"zorro attention: sliding-window attention (window {sliding_window}) is not supported; "
                         "disable use_sliding_window in the model config or do not use zorro for this model.")
    if softcap is not None:
        raise ValueError("zorro attention: attention logit soft-capping is not supported.")
    if dropout:
        raise ValueError(f"zorro attention: attention dropout {dropout} is not supported (RL training uses 0); "
                         "set config.attention_dropout = 0.")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    zorro_plan._cache["attn_calls"] = zorro_plan._cache.get("attn_calls", 0) + 1
    return attend(zorro_plan, query, key, value, scaling), None


def register_zorro_attention() -> None:
    """Register :func:`zorro_attention_forward` as ``"zorro"`` in transformers' AttentionInterface (idempotent)."""
    from transformers import AttentionInterface

    if AttentionInterface._global_mapping.get(ZORRO_ATTN_NAME) is not zorro_attention_forward:
        AttentionInterface.register(ZORRO_ATTN_NAME, zorro_attention_forward)


def _config(model):
    return model.config


def is_installed(model) -> bool:
    return getattr(_config(model), "_attn_implementation", None) == ZORRO_ATTN_NAME


def _num_attention_layers(model) -> int:
    """Decoder layers whose sequence mixing must call the ``"zorro"`` attention: the ``full_attention`` ones of
    ``config.layer_types`` when the config lists them (hybrid models), else ``config.num_hidden_layers``."""
    cfg = _config(model)
    cfg = getattr(cfg, "text_config", None) or cfg
    n = getattr(cfg, "num_hidden_layers", None)
    if not isinstance(n, int):
        raise ValueError(f"model: cannot tell its decoder layer count (config.num_hidden_layers is {n!r}); zorro "
                         "supports decoder-only language models.")
    types = getattr(cfg, "layer_types", None)
    if types:
        return sum(t == "full_attention" for t in types[:n])
    return n


def _check_layer_types(model) -> None:
    """Refuse (at patch time) any layer type whose sequence mixing zorro does not handle.

    ``full_attention`` goes through the registered attention; ``linear_attention`` (gated delta-net, Qwen3.5 /
    Qwen3-Next) through the instance wrappers of :mod:`zorro_verl.integrations.hybrid`, which check the module.
    """
    cfg = _config(model)
    cfg = getattr(cfg, "text_config", None) or cfg
    types = getattr(cfg, "layer_types", None)
    if types:
        other = sorted({t for t in types if t not in _HANDLED_LAYER_TYPES})
        if other:
            raise ValueError(
                f"model: layers of type {other} do not mix the sequence through zorro (only "
                f"{list(_HANDLED_LAYER_TYPES)} are handled). Running them over the packed row would let one response "
                "see its siblings — refused. Use a model whose layers are all of the handled types.")
    hybrid.check_linear_attention_supported(model)


def install_zorro(model, *, probe: bool = True) -> None:
    """Switch ``model`` to zorro attention (idempotent) and, with ``probe``, verify every layer dispatches to it.

    The probe is a no-grad forward of a 2-row, 1-group batch of a few tokens; it must call the zorro attention once
    per decoder layer. Raises ``ValueError`` otherwise and restores the model's previous attention.
    """
    register_zorro_attention()
    _check_layer_types(model)
    if is_installed(model):
        hybrid.wrap_linear_attention(model)  # idempotent
        return
    previous = getattr(_config(model), "_attn_implementation", None)
    model.set_attn_implementation(ZORRO_ATTN_NAME)
    model._zorro_previous_attn = previous
    try:
        hybrid.wrap_linear_attention(model)
    except Exception:
        uninstall_zorro(model)
        raise
    if not probe:
        return
    try:
        _probe(model)
    except Exception:
        uninstall_zorro(model)
        raise


def uninstall_zorro(model) -> None:
    """Restore the attention implementation (and linear-attention forwards) the model had before
    :func:`install_zorro`."""
    hybrid.unwrap_linear_attention(model)
    prev = getattr(model, "_zorro_previous_attn", None)
    if is_installed(model):
        model.set_attn_implementation(prev or "sdpa")


def _probe(model) -> None:
    emb = model.get_input_embeddings()
    dev = emb.weight.device
    vocab = emb.weight.shape[0]
    ids = (torch.arange(10, device=dev) % max(vocab - 1, 1) + 1).view(2, 5)
    ids[:, :3] = ids[0, :3]  # one shared 3-token prompt, two 2-token responses
    plan = build_plan(ids, None, 2, backend="sdpa")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            _decoder_forward(model, plan)
    finally:
        model.train(was_training)


def _decoder_forward(model, plan: ZorroPlan) -> torch.Tensor:
    """Run the decoder on the packed row. Returns hidden states ``[T, H]``; checks one attention call per layer."""
    if not is_installed(model):
        raise ValueError("model: zorro is not installed on this model (its attn_implementation is "
                         f"{getattr(_config(model), '_attn_implementation', None)!r}). Call install_zorro(model) "
                         "or DeduplicatedActor.patch() first.")
    reset_layer_calls(plan)
    decoder = model.get_decoder()
    out = decoder(input_ids=plan.input_ids[None], position_ids=plan.position_ids[None], zorro_plan=plan,
                  use_cache=False)
    check_layer_calls(model, plan)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden[0]  # [T, H]


def reset_layer_calls(plan: ZorroPlan) -> None:
    """Zero the per-forward counters of zorro's sequence mixers (attention and gated delta-net) in ``plan``."""
    plan._cache["attn_calls"] = 0
    plan._cache["recurrent_calls"] = 0


def check_layer_calls(model, plan: ZorroPlan) -> None:
    """After one decoder forward on ``plan`` (counters zeroed by :func:`reset_layer_calls`): every full-attention
    layer called the zorro attention once and every linear-attention layer ran zorro's gated delta-net forward once.
    Raises ``ValueError`` otherwise (a layer bypassed zorro: the deduplicated result would be wrong)."""
    calls, expected = plan._cache.get("attn_calls", 0), _num_attention_layers(model)
    if calls != expected:
        raise ValueError(
            f"model: {expected} attention layers but the zorro attention was called {calls} times; some layers do "
            "not dispatch attention through transformers' ALL_ATTENTION_FUNCTIONS (or mix the sequence another "
            "way), so the deduplicated forward would be wrong. This model is not supported by zorro.")
    rec_calls, rec_expected = plan._cache.get("recurrent_calls", 0), len(hybrid.linear_attention_modules(model))
    if rec_calls != rec_expected:
        raise ValueError(
            f"model: {rec_expected} linear-attention layers but zorro's gated delta-net forward ran {rec_calls} "
            "times; a linear-attention module was bypassed or replaced after install_zorro. Call install_zorro(model) "
            "again after changing the model.")


def zorro_forward(model, plan: ZorroPlan, *, temperature: float = 1.0, calculate_entropy: bool = False,
                  logits_mode: str = "none", chunk_size: int = 1024):
    """Deduplicated forward: log-probs (and entropy) of every valid response token, original row order.

    Args:
        model: a ``*ForCausalLM`` with zorro installed (:func:`install_zorro`).
        plan: the micro-batch's plan (:func:`~zorro_verl.packing.build_plan`).
        temperature: logits are divided by it (per call).
        calculate_entropy: also compute the entropy.
        logits_mode: ``none | compute | memory`` (:mod:`zorro_verl.logprob`).

    Returns:
        ``(log_probs [N], entropy [N] | None)`` — fp32 (fp64 for fp64 models); ``plan.to_padded`` gives ``[B, R]``.
    """
    hidden = _decoder_forward(model, plan)  # [T, H]
    h = hidden.index_select(0, plan.logit_index)  # [N, H], never a roll of the packed row
    return response_logprobs(h, model.get_output_embeddings(), plan.target_ids, temperature=temperature,
                             calculate_entropy=calculate_entropy, mode=logits_mode, chunk_size=chunk_size)
