"""The attention function registered as ``"zorro"`` in transformers' ``AttentionInterface`` (docs/design/attention.md).

No mask function is registered with it, so transformers passes ``attention_mask=None`` and builds no O(T^2) mask;
the structure comes from the plan in the ``zorro_ctx`` kwarg. The name must not contain "flash", "sdpa",
"flex_attention" or "/", which trigger transformers' own dispatch logic.
"""

from __future__ import annotations

from typing import Optional

import torch

from zorro_verl.attention import AttentionFeatures, attend
from zorro_verl.attention.ulysses import ulysses_attend
from zorro_verl.integrations.transformers.context import ModelMaskError, StepContext, require_context
from zorro_verl.integrations.transformers.positions import apply_query_temperature

__all__ = ["ZORRO_ATTN_NAME", "register_zorro_attention", "zorro_attention_forward", "layer_chunk",
           "CHUNKED_ATTENTION"]

ZORRO_ATTN_NAME = "zorro"


#: Keywords transformers' decoders pass to every attention function that do not change the attention's math here:
#: positions (zorro's come from the plan, which the step also passes as position_ids), cache and output switches.
_INERT_KWARGS = frozenset({"position_ids", "cache_position", "use_cache", "output_router_logits",
                           "output_hidden_states", "return_dict"})


#: transformers' layer type of chunked local attention (Llama 4): a query sees the keys of its own chunk of
#: ``config.attention_chunk_size`` positions (``create_chunked_causal_mask``), which transformers passes to the
#: attention function only as a mask — zorro registers none, so the chunk is read from the layer's config.
CHUNKED_ATTENTION = "chunked_attention"


def layer_chunk(module: torch.nn.Module) -> Optional[int]:
    """The chunk size of ``module``'s layer: ``config.attention_chunk_size`` when ``config.layer_types[layer_idx]``
    is ``chunked_attention``, else None. Raises ``ValueError`` for a chunked layer without a chunk size."""
    cfg, idx = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(cfg, "layer_types", None)
    if not types or not isinstance(idx, int) or idx >= len(types) or types[idx] != CHUNKED_ATTENTION:
        return None
    chunk = getattr(cfg, "attention_chunk_size", None)
    if chunk is None:
        raise ValueError(f"model: layer {idx} is a chunked_attention layer but config.attention_chunk_size is None; "
                         "set the chunk size the ordinary forward's mask uses.")
    return chunk


def zorro_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                            scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                            softcap: Optional[float] = None, s_aux: Optional[torch.Tensor] = None,
                            zorro_ctx: Optional[StepContext] = None, **kwargs):
    """The attention function registered as ``"zorro"``.

    Every keyword that changes the math is honoured or refused, none ignored: ``scaling`` (default
    ``D ** -0.5``), ``sliding_window`` (this layer's window, on the original per-row positions), ``softcap``
    (attention logit soft-capping, Gemma 2) and ``s_aux`` (per-head sink logits ``[Hq]``, gpt-oss) become the
    layer's :class:`~zorro_verl.attention.AttentionFeatures`; ``dropout > 0``, a non-causal module
    (``module.is_causal`` False: bidirectional attention), ``is_causal=False``, ``output_attentions=True`` and any
    keyword not known to be inert raise ``ValueError``. A ``chunked_attention`` layer (Llama 4) gets its chunk
    from the module's config (:func:`layer_chunk`: transformers passes it only as a mask), and a query temperature
    moved out of the module at install (Llama 4's NoPE layers, :mod:`.positions`) is applied here from each token's
    own position.

    Args:
        query: ``[1, Hq, T, D]``; key/value: ``[1, Hkv, T, D]`` (RoPE / q-k-norm applied, GQA not expanded); under
            Ulysses sequence parallelism (``zorro_ctx.shard``) this rank's slice ``[1, H, L, D]``.
        attention_mask: must be ``None`` (zorro registers no mask function; the plan carries the structure).
        zorro_ctx: the :class:`StepContext` of the call (plan, backend, layer-call counter).

    Returns:
        ``([1, T, Hq, D], None)`` (``[1, L, Hq, D]``, this rank's slice, under sequence parallelism).
    """
    ctx = require_context(zorro_ctx, f"zorro attention ({type(module).__name__})")
    plan = ctx.plan
    if attention_mask is not None:
        raise ModelMaskError(f"zorro attention ({type(module).__name__}): got an attention_mask; the model built a "
                             "mask although zorro registers none. Call the model without attention_mask (the plan "
                             "carries the structure).")
    shard = ctx.shard
    length = plan.T if shard is None else shard.local_len
    if query.dim() != 4 or query.shape[0] != 1 or query.shape[2] != length:
        what = "one packed row" if shard is None else f"this rank's slice of {shard.sp_size}"
        raise ValueError(f"zorro attention: expected query [1, Hq, {length}, D] ({what}), got "
                         f"{tuple(query.shape)}. Run the model through zorro_step (it passes the right input_ids).")
    if dropout:
        raise ValueError(f"zorro attention: attention dropout {dropout} in training mode is not supported (RL "
                         "training uses 0: dropout would make the two forwards of a step differ anyway); set "
                         "config.attention_dropout = 0.")
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal", True) is False:
        raise ValueError(f"zorro attention: {type(module).__name__} attends bidirectionally (is_causal=False, e.g. "
                         "use_bidirectional_attention=True); split attention is causal only. Use a causal model.")
    if kwargs.get("output_attentions"):
        raise ValueError("zorro attention: output_attentions=True is not supported (zorro never materialises the "
                         "attention weights). Call the model with output_attentions=False.")
    # encoder_hidden_states=None: a decoder with optional cross-attention (BERT-style is_decoder) running
    # self-attention; a tensor there is cross-attention and is refused as unknown below
    unknown = sorted(k for k in set(kwargs) - _INERT_KWARGS - {"is_causal", "output_attentions"}
                     if not (k == "encoder_hidden_states" and kwargs[k] is None))
    if unknown:
        raise ValueError(f"zorro attention: {type(module).__name__} passed keyword(s) {unknown} that zorro does not "
                         "know; they may change the attention's math, so they are refused rather than ignored. "
                         "This model is not supported by zorro.")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    features = AttentionFeatures(window=sliding_window, sinks=s_aux, softcap=softcap, chunk=layer_chunk(module))
    # Llama 4's NoPE query temperature, from each token's position in its own row (the module's own code would
    # read the packed index; install_zorro switched that off: positions.fix_query_temperature)
    query = apply_query_temperature(module, query, (plan if shard is None else shard).position_ids)
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):  # stock SDPA is an autocast op: it attends in the autocast dtype
        low = torch.get_autocast_dtype(device_type)  # (q / k can leave a norm + RoPE in fp32 while v is low)
        query, key, value = query.to(low), key.to(low), value.to(low)
    ctx.calls.attention += 1
    ctx.calls.record_features(getattr(module, "layer_idx", None), features, scaling, module)
    if shard is not None:  # Ulysses: exchange sequence shards for head shards around the backend
        return ulysses_attend(plan, ctx.backend, shard, query, key, value, scaling, features), None
    return attend(plan, ctx.backend, query, key, value, scaling, features), None


def register_zorro_attention() -> None:
    """Register :func:`zorro_attention_forward` as ``"zorro"`` in transformers' AttentionInterface (idempotent)."""
    from transformers import AttentionInterface

    if AttentionInterface._global_mapping.get(ZORRO_ATTN_NAME) is not zorro_attention_forward:
        AttentionInterface.register(ZORRO_ATTN_NAME, zorro_attention_forward)
