"""The FLOP model of docs/design/math.md with a model's real dimensions: what the ordinary padded forward computes
vs what zorro's deduplicated forward computes.

Counted: matmul FLOPs of every linear layer per token (2 per multiply-add), attention ``4 Hq D`` per (query, key)
pair actually needed (causal), the LM head on the rows each side computes; gated delta-net layers per token.
Inputs are the per-row lengths of a batch (``[B] int64`` CPU tensors); outputs are Python ints.

Vision-language models (Qwen2.5-VL's vision tower, :func:`vision_flops` / :func:`vlm_flop_model`): per patch the
patch embedding, each block's qkv / proj / SwiGLU MLP and the patch merger; ``4 Hv`` per (query, key) pair of each
block's attention as the model computes it (bidirectional, windowed blocks within each window, full-attention blocks
within each frame); ordinary = every row encodes its own images, zorro = each unique item once.
"""

from __future__ import annotations

import torch

__all__ = ["flop_model", "tree_flop_model", "layer_costs", "attention_pairs", "linear_flops_per_token",
           "mlp_flops_per_token", "linear_attention_flops_per_token", "vision_patch_flops", "vision_attention_pairs",
           "vision_flops", "vlm_flop_model"]

#: Model types whose full-attention q_proj also produces a per-head output gate (twice the query width).
_GATED_ATTENTION = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")


def linear_attention_flops_per_token(cfg) -> int:
    """Forward FLOPs per token of one gated delta-net token mixer (Qwen3.5 / Qwen3-Next), from the config:
    the q/k/v/z/b/a and output projections, the depthwise causal conv, and the recurrent state update + readout
    (per value head a ``[Dk, Dv]`` state: decay-and-correct, rank-1 update, query readout ~ 6 Dk Dv)."""
    H = cfg.hidden_size
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    key_dim, value_dim = nk * dk, nv * dv
    proj = H * (2 * key_dim + value_dim) + H * value_dim + 2 * H * nv + value_dim * H
    conv = (2 * key_dim + value_dim) * cfg.linear_conv_kernel_dim
    return 2 * (proj + conv) + 6 * nv * dk * dv


def mlp_flops_per_token(cfg) -> int:
    """Forward FLOPs per token of one layer's MLP (dense SwiGLU, or the routed experts + router of an MoE)."""
    H = cfg.hidden_size
    if getattr(cfg, "num_experts", None):
        return 2 * (cfg.num_experts_per_tok * 3 * H * cfg.moe_intermediate_size + H * cfg.num_experts)
    return 2 * 3 * H * cfg.intermediate_size


def linear_flops_per_token(cfg) -> int:
    """Forward matmul FLOPs of one full-attention decoder layer per token (2 per multiply-add), from the config:
    the q/k/v/o projections and the MLP."""
    H = cfg.hidden_size
    D = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
    Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    q_out = 2 * Hq * D if cfg.model_type in _GATED_ATTENTION else Hq * D  # q_proj = query + output gate
    return 2 * (H * q_out + 2 * H * Hkv * D + Hq * D * H) + mlp_flops_per_token(cfg)


def layer_costs(cfg) -> tuple[int, int, int]:
    """``(L, per_token, per_pair)``: the number of full-attention layers, the forward FLOPs per token of all decoder
    layers (each full-attention layer's projections and MLP, each gated delta-net layer's mixer and MLP) and the
    attention FLOPs per causal (query, key) pair of one full-attention layer (``4 Hq D``: QK^T and PV)."""
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)
    L, L_lin = types.count("full_attention"), types.count("linear_attention")
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = L * linear_flops_per_token(cfg)
    if L_lin:
        per_token += L_lin * (linear_attention_flops_per_token(cfg) + mlp_flops_per_token(cfg))
    return L, per_token, 4 * cfg.num_attention_heads * D


def attention_pairs(p_len: torch.Tensor, r_len: torch.Tensor, row_group: torch.Tensor, S: int) -> tuple[int, int]:
    """Causal (query, key) pairs per head and layer: ``(ordinary, zorro)``.

    Ordinary: every position of the ``B`` padded rows of width ``S`` (``B S (S+1) / 2``, what it computes);
    zorro: each unique prompt once, each response against its prompt and causally itself.
    ``p_len [B]``, ``r_len [B]``, ``row_group [B]``: int64 valid prompt / response length and group id per row.
    """
    B = p_len.numel()
    G = int(row_group.max()) + 1
    p_group = torch.zeros(G, dtype=torch.long).scatter_(0, row_group, p_len)
    base_pairs = B * S * (S + 1) // 2
    z_pairs = int((p_group * (p_group + 1) // 2).sum() + (r_len * p_len + r_len * (r_len + 1) // 2).sum())
    return base_pairs, z_pairs


def flop_model(cfg, p_len: torch.Tensor, r_len: torch.Tensor, row_group: torch.Tensor, S: int,
               adapter_per_token: int = 0) -> dict:
    """Forward FLOPs of the ordinary padded forward and of zorro's deduplicated forward.

    Args:
        cfg: the model config (real dimensions).
        p_len: ``[B] int64`` valid prompt length per row; r_len: ``[B] int64`` valid response length per row.
        row_group: ``[B] int64`` group id per row. S: padded row width of the baseline batch.
        adapter_per_token: LoRA adapters' forward FLOPs per token (all layers;
            :func:`~zorro_verl.integrations.transformers.lora.lora_flops_per_token`), 0 for full fine-tuning.

    Returns:
        dict of ints: ``baseline`` (padded rows, response-only head), ``baseline_full`` (padded rows, logits
        everywhere), ``zorro``; each is linear + attention (+ head) (+ adapters), forward only. The ``*_fwd_bwd``
        keys add the backward: 2x forward for everything that trains (full fine-tuning: the ratios equal the
        forward's), and with LoRA (``adapter_per_token > 0``: the base weights and the head frozen) 1x forward for
        the base linear layers and the head (input gradients only), 2x for the adapters and attention. Also
        ``baseline_tokens``, ``zorro_tokens`` and ``N`` (valid response tokens).
    """
    L, per_token, per_pair = layer_costs(cfg)  # gated delta-net layers cost per token only
    H, V = cfg.hidden_size, cfg.vocab_size
    B = p_len.numel()
    N = int(r_len.sum())
    G = int(row_group.max()) + 1
    p_group = torch.zeros(G, dtype=torch.long).scatter_(0, row_group, p_len)
    base_tokens = B * S
    z_tokens = int(p_group.sum()) + N
    base_pairs, z_pairs = attention_pairs(p_len, r_len, row_group, S)
    frozen = 2 if adapter_per_token else 3  # forward + backward multiple of the base linears and the head

    def cost(tokens: int, pairs: int, head_rows: int) -> tuple[int, int]:
        lin, attn, ad = per_token * tokens, L * per_pair * pairs, adapter_per_token * tokens
        head = 2 * H * V * head_rows
        return lin + attn + head + ad, frozen * (lin + head) + 3 * (attn + ad)

    base, base_fb = cost(base_tokens, base_pairs, N)
    full, full_fb = cost(base_tokens, base_pairs, base_tokens)
    zorro, zorro_fb = cost(z_tokens, z_pairs, N)
    return {"baseline": base, "baseline_full": full, "zorro": zorro, "baseline_fwd_bwd": base_fb,
            "baseline_full_fwd_bwd": full_fb, "zorro_fwd_bwd": zorro_fb,
            "baseline_tokens": base_tokens, "zorro_tokens": z_tokens, "N": N}


def tree_flop_model(cfg, plan) -> dict:
    """Forward FLOPs of zorro's forward over a prefix-tree plan (``plan.tree`` set), in the terms of
    :func:`flop_model`: every node's tokens once; a node's queries attend to its ancestors' keys and causally to
    its own (``len * pos0 + len (len + 1) / 2`` pairs); the LM head on the distinct predicting rows (``Nh``);
    gated delta-net layers per token.
    Returns ``zorro``, ``zorro_tokens``, ``pairs`` and ``head_rows`` (ints)."""
    L, per_token, per_pair = layer_costs(cfg)  # gated delta-net layers: per token (each node once)
    t = plan.tree
    ln, pos0 = t.node_len.cpu(), t.node_pos0.cpu()
    pairs = int((ln * pos0 + ln * (ln + 1) // 2).sum())
    head_rows = int(plan.head_index.numel())
    z = per_token * plan.T + L * per_pair * pairs + 2 * cfg.hidden_size * cfg.vocab_size * head_rows
    return {"zorro": z, "zorro_tokens": plan.T, "pairs": pairs, "head_rows": head_rows}


def _check_vision_config(vcfg) -> None:
    if getattr(vcfg, "model_type", None) != "qwen2_5_vl_vision" or getattr(vcfg, "window_size", None) is None:
        raise ValueError(f"vision FLOP model: counts Qwen2.5-VL's vision tower (windowed + full-attention blocks, "
                         f"SwiGLU MLP, one patch merger), got a {getattr(vcfg, 'model_type', None)!r} vision config.")


def vision_patch_flops(vcfg) -> tuple[int, int]:
    """``(embed, per_patch)``: forward FLOPs per patch of Qwen2.5-VL's patch embedding (a Conv3d with stride = kernel:
    a ``C Tp p^2 -> Hv`` matmul) and of everything else that costs per patch: each block's qkv (``Hv -> 3 Hv``),
    proj (``Hv -> Hv``) and SwiGLU MLP (``3 Hv Iv``), and the patch merger (``Hm = Hv m^2``: ``Hm -> Hm -> out`` per
    merged token, i.e. ``2 Hv (Hm + out)`` per patch). Attention is counted per pair (:func:`vision_attention_pairs`).
    """
    _check_vision_config(vcfg)
    Hv, Iv, m = vcfg.hidden_size, vcfg.intermediate_size, vcfg.spatial_merge_size
    embed = 2 * vcfg.in_channels * vcfg.temporal_patch_size * vcfg.patch_size ** 2 * Hv
    block = 2 * (4 * Hv * Hv + 3 * Hv * Iv)
    merger = 2 * Hv * (Hv * m * m + vcfg.out_hidden_size)
    return embed, vcfg.depth * block + merger


def vision_attention_pairs(vcfg, grid) -> tuple[int, int]:
    """``(window, full)``: (query, key) pairs per head of one windowed block and one full-attention block for one
    item of grid ``(t, h, w)`` (patches), as Qwen2.5-VL computes them: bidirectional, each frame alone (full:
    ``(h w)^2`` per frame); windows of ``ws = window_size / merge / patch`` merged tokens a side tiled from the top
    left corner (the last row / column of windows cut short), each window ``(rows cols merge^2)^2``."""
    _check_vision_config(vcfg)
    t, h, w = (int(x) for x in grid)
    m = vcfg.spatial_merge_size
    ws = vcfg.window_size // m // vcfg.patch_size
    lh, lw = h // m, w // m
    rows = [min(ws, lh - i) for i in range(0, lh, ws)]
    cols = [min(ws, lw - j) for j in range(0, lw, ws)]
    window = t * sum((r * c * m * m) ** 2 for r in rows for c in cols)
    return window, t * (h * w) ** 2


def vision_flops(vcfg, grids) -> dict:
    """FLOPs of Qwen2.5-VL's vision tower encoding the items of ``grids`` (``[k, 3]`` int, patches; one row per
    item, each encoded once): ``fwd`` and ``fwd_bwd`` (a trained tower: 3x forward for the blocks, the merger and
    attention; 2x for the patch embedding, whose input, the pixels, needs no gradient), ``patches``, ``items``."""
    embed, per_patch = vision_patch_flops(vcfg)
    full_blocks = len(set(vcfg.fullatt_block_indexes) & set(range(vcfg.depth)))
    per_pair = 4 * vcfg.hidden_size
    patches = pairs = 0
    for g in (grids.tolist() if torch.is_tensor(grids) else grids):
        window, full = vision_attention_pairs(vcfg, g)
        patches += int(g[0]) * int(g[1]) * int(g[2])
        pairs += (vcfg.depth - full_blocks) * window + full_blocks * full
    lin, attn = per_patch * patches, per_pair * pairs
    return {"fwd": embed * patches + lin + attn, "fwd_bwd": 2 * embed * patches + 3 * (lin + attn),
            "patches": patches, "items": len(grids)}


def vlm_flop_model(cfg, p_len: torch.Tensor, r_len: torch.Tensor, row_group: torch.Tensor, S: int, row_grids,
                   packed_grids) -> dict:
    """Forward (and forward + backward) FLOPs of a vision-language batch, ordinary padded forward vs zorro.

    The language model as :func:`flop_model` (``cfg.text_config``; placeholders are tokens like any other, the
    response-only head), plus the vision tower (:func:`vision_flops`): the ordinary forward encodes every row's
    items (``row_grids [sum_b k_b, 3]``), zorro each unique prompt's items once (``packed_grids [k, 3]``).
    Returns ``baseline``, ``zorro``, ``baseline_fwd_bwd``, ``zorro_fwd_bwd`` (totals), the vision parts
    ``vision_baseline(_fwd_bwd)`` / ``vision_zorro(_fwd_bwd)``, ``images_baseline`` / ``images_zorro`` (items
    encoded), ``patches_baseline`` / ``patches_zorro``, and the text model's ``baseline_tokens``, ``zorro_tokens``,
    ``N``."""
    text = flop_model(cfg.text_config, p_len, r_len, row_group, S)
    vb, vz = vision_flops(cfg.vision_config, row_grids), vision_flops(cfg.vision_config, packed_grids)
    out = {k: text[k] for k in ("baseline_tokens", "zorro_tokens", "N")}
    for side, v in (("baseline", vb), ("zorro", vz)):
        out[side] = text[side] + v["fwd"]
        out[f"{side}_fwd_bwd"] = text[f"{side}_fwd_bwd"] + v["fwd_bwd"]
        out[f"vision_{side}"], out[f"vision_{side}_fwd_bwd"] = v["fwd"], v["fwd_bwd"]
        out[f"images_{side}"], out[f"patches_{side}"] = v["items"], v["patches"]
    return out
