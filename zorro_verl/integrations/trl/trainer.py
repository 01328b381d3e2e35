"""zorro inside Hugging Face TRL's ``GRPOTrainer`` (TRL 1.16; docs/trl.md).

Every training-time log-prob of TRL's GRPO goes through ``GRPOTrainer._get_per_token_logps_and_entropies`` (the
policy loss with grad, the old log-probs, the reference: a separate model or the PEFT adapter disabled). Its
inputs are zorro's layout (left-padded prompt + right-padded completion, ``logits_to_keep`` = completion width), so
the override builds a plan per row chunk (the same chunks as stock) and runs :func:`zorro_step`; outputs are
``[B, C]`` with 0 on pads, as stock's.

* HF ``generate`` runs the same module: zorro is switched off around ``_generate`` (rollouts) and back on after.
* Gradient checkpointing (TRL's default, reentrant or not) recomputes the layers during backward: zorro stays
  installed from the first log-prob call to the next rollout, never only around the forward; ``train()`` hands the
  models back with their own attention when it returns.
* Optimizer steps see the rows stock TRL gives them (the row shuffle of ``_prepare_inputs`` is left alone). Opt-in
  ``micro_batch_order='groups'``: the shuffle keeps each prompt's completions adjacent (whole groups per micro-batch)
  where that leaves every optimizer step's gradient unchanged (:data:`GROUP_ORDER_LOSS_TYPES`, refused otherwise).
* Image GRPO on a Qwen2-VL-family model (``pixel_values`` / ``image_grid_thw`` / ``num_images``): each chunk's rows
  get their own images and the 3-D positions the model's ``get_rope_index`` gives them, and run through zorro's
  media plan (:func:`~zorro_verl.packing.multimodal.build_media_plan`): each unique prompt (tokens *and* pixels
  equal) and its images are encoded once.
* What cannot be exact (MoE auxiliary loss, other model families' multimodal inputs, Liger's fused loss, an
  untested TRL version or loss type) is refused by name, or with ``on_unsupported='warn'`` runs TRL's stock forward
  (warned once, counted in ``zorro/fallbacks``).

Two ways in: :class:`ZorroGRPOTrainer` (a subclass taking ``zorro={...}``) or :func:`enable` (patches
``trl.GRPOTrainer`` itself, so an unmodified script runs deduplicated; :func:`disable` undoes it).
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any, Optional

import torch
import trl
import trl.trainer.grpo_trainer as grpo_module
from trl import GRPOTrainer

from zorro_verl.integrations.transformers import install_zorro, is_installed, uninstall_zorro, zorro_step
from zorro_verl.integrations.transformers.vision import is_multimodal, media_tokens, rope_positions, token_types
from zorro_verl.integrations.trl.settings import FIX_HINT, TESTED_TRL, trl_settings
from zorro_verl.integrations.verl.settings import ZorroSettings
from zorro_verl.packing import build_plan
from zorro_verl.packing.multimodal import build_media_plan

__all__ = ["ZorroGRPOTrainer", "enable", "disable", "is_enabled", "SUPPORTED_LOSS_TYPES", "GROUP_ORDER_LOSS_TYPES",
           "check_trl_version", "group_order_unsupported", "group_keeping_permutation"]

logger = logging.getLogger(__name__)

#: TRL 1.16's loss types. Each only reads the per-token log-probs / entropies this override returns (equal to
#: stock's), so each equals stock; tested one by one in tests/integrations/trl.
SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo", "luspo")
#: The loss types whose step gradient does not depend on which rows share a micro-batch of the step (equal-size
#: micro-batches; per-row terms summed with a constant or step-global normaliser): ``grpo`` / ``sapo`` / ``luspo``
#: (per-row value, mean over the micro-batch's rows, / accumulation), ``dr_grpo`` (/ rows x max length), ``dapo`` /
#: ``cispo`` / ``vespo`` (/ the generation batch's token count). Not ``bnpo``: it divides by the micro-batch's tokens.
GROUP_ORDER_LOSS_TYPES = ("grpo", "sapo", "luspo", "dr_grpo", "dapo", "cispo", "vespo")
#: The multimodal keywords of the seam (TRL's image GRPO). The Qwen2-VL family's (:data:`_QWEN_MEDIA_KEYS`) run
#: through zorro's media plan; the others (tile-indexed InternVL / LFM2-VL, LLaVA-style ``image_sizes``, Gemma's
#: ``token_type_ids``, ...) are refused.
_MEDIA_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
               "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")
_QWEN_MEDIA_KEYS = ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids")
#: The GRPOTrainer methods zorro replaces (the same functions for the subclass and for :func:`enable`).
_METHODS = ("__init__", "_get_per_token_logps_and_entropies", "_generate", "_prepare_inputs", "train")
_STOCK = {name: getattr(GRPOTrainer, name) for name in _METHODS}
_OWN = {name for name in _METHODS if name in GRPOTrainer.__dict__}  # the rest (train) are inherited
_enabled: Optional[ZorroSettings] = None


def check_trl_version(on_unsupported: str = "raise", version: Optional[str] = None) -> None:
    """Refuse a TRL outside :data:`TESTED_TRL` (the seam is a private method); ``warn`` only warns."""
    version = trl.__version__ if version is None else version
    if version.startswith(TESTED_TRL):
        return
    msg = (f"zorro for TRL: trl {version} is not the tested version ({TESTED_TRL}x); the deduplicated seam "
           f"(GRPOTrainer._get_per_token_logps_and_entropies) is private and may have changed. Install "
           f"trl=={TESTED_TRL}0, or {FIX_HINT}.")
    if on_unsupported == "raise":
        raise ValueError(msg)
    warnings.warn(msg, stacklevel=3)


class _State:
    """Per-trainer zorro state: settings, resolved backend, the models zorro is installed on, counters."""

    def __init__(self, settings: ZorroSettings, device_type: str):
        self.settings = settings
        self.backend = settings.resolved_backend(device_type)
        self.installed: list = []  # unwrapped models with zorro installed (policy, separate reference)
        self.probed: set = set()
        self.warned: set = set()
        self.unsupported: Optional[str] = None  # a start-time refusal under on_unsupported=warn: every call stock
        self.group_order = False  # micro_batch_order='groups' accepted for this trainer

    def refuse(self, reason: str) -> None:
        """Raise ``ValueError(reason + fix)`` or (``warn``) warn once per reason."""
        msg = f"{reason}; or {FIX_HINT}."
        if self.settings.on_unsupported == "raise":
            raise ValueError(msg)
        if reason not in self.warned:
            self.warned.add(reason)
            warnings.warn(msg + " Running TRL's stock forward for these calls.", stacklevel=4)


def _start_checks(trainer) -> Optional[str]:
    """The reason this trainer cannot run zorro exactly (None when it can): checked once, at construction."""
    args = trainer.args
    loss_type = getattr(args, "loss_type", None)
    if loss_type not in SUPPORTED_LOSS_TYPES:
        return (f"zorro for TRL: loss_type={loss_type!r} is not one of the tested loss types "
                f"{list(SUPPORTED_LOSS_TYPES)}")
    if getattr(args, "use_liger_kernel", False) or getattr(trainer, "use_liger_kernel", False):
        return ("zorro for TRL: use_liger_kernel=True swaps the model's layer kernels for Liger's (RMSNorm, RoPE, "
                "SwiGLU), which zorro's packed forward is not tested with; set use_liger_kernel=False")
    return None


def group_order_unsupported(args) -> Optional[str]:
    """Why ``micro_batch_order='groups'`` would change an optimizer step's gradient under ``args`` (a GRPOConfig), or
    None: another loss type, micro-batches of different optimizer steps in one generation batch, or a term computed
    per micro-batch (the entropy bonus, the high-entropy token threshold)."""
    if args.loss_type not in GROUP_ORDER_LOSS_TYPES:
        return (f"zorro for TRL: micro_batch_order='groups' with loss_type={args.loss_type!r}: its normaliser is "
                f"per micro-batch, so regrouping rows changes the step's gradient (group order keeps it only for "
                f"{list(GROUP_ORDER_LOSS_TYPES)}); use micro_batch_order='stock'")
    if args.steps_per_generation != args.gradient_accumulation_steps:
        return (f"zorro for TRL: micro_batch_order='groups' with steps_per_generation={args.steps_per_generation} != "
                f"gradient_accumulation_steps={args.gradient_accumulation_steps}: the order would move rows between "
                "optimizer steps; use micro_batch_order='stock' or leave steps_per_generation unset")
    if getattr(args, "entropy_coef", 0.0) or getattr(args, "top_entropy_quantile", 1.0) < 1.0:
        return ("zorro for TRL: micro_batch_order='groups' with entropy_coef != 0 or top_entropy_quantile < 1: both "
                "are computed per micro-batch, so regrouping rows changes the step's gradient; use "
                "micro_batch_order='stock'")
    return None


def group_keeping_permutation(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, stock: torch.Tensor):
    """The row order of ``micro_batch_order='groups'``: ``[B] int64``, each prompt's rows adjacent (in their original
    order), the groups in the order their first row appears in ``stock`` (TRL's own ``randperm(B)``: the same random
    draw as stock, so the RNG stream after it is stock's). Groups = rows with identical valid prompt tokens."""
    firsts: dict = {}
    rows: dict = {}
    rank = torch.empty_like(stock)
    rank[stock] = torch.arange(stock.numel())
    for i in range(prompt_ids.size(0)):
        key = tuple(prompt_ids[i][prompt_mask[i].bool()].tolist())
        rows.setdefault(key, []).append(i)
        firsts[key] = min(firsts.get(key, stock.numel()), int(rank[i]))
    order = sorted(rows, key=firsts.__getitem__)
    return torch.tensor([i for key in order for i in rows[key]], dtype=torch.long)


def _group_shuffle(seq_dict: dict) -> dict:
    """TRL's ``shuffle_sequence_dict`` with :func:`group_keeping_permutation` for the order."""
    batch = len(next(v for v in seq_dict.values() if v is not None))
    perm = group_keeping_permutation(seq_dict["prompt_ids"].cpu(), seq_dict["prompt_mask"].cpu(),
                                     torch.randperm(batch))

    def permute(v):
        if v is None or (isinstance(v, torch.Tensor) and v.ndim == 0):
            return v
        if isinstance(v, torch.Tensor):
            return v[perm.to(v.device)]
        return [v[i] for i in perm]

    return {k: permute(v) for k, v in seq_dict.items()}


def _prepare_inputs(self, stock, generation_batch):
    """Stock's, with the group-keeping shuffle under ``micro_batch_order='groups'``."""
    st: Optional[_State] = getattr(self, "_zorro", None)
    if st is None or not st.group_order:
        return stock(generation_batch)
    original = grpo_module.shuffle_sequence_dict
    grpo_module.shuffle_sequence_dict = _group_shuffle  # TRL calls it by this module-level name
    try:
        return stock(generation_batch)
    finally:
        grpo_module.shuffle_sequence_dict = original


def _setup(trainer, settings: ZorroSettings) -> None:
    check_trl_version(settings.on_unsupported)
    st = _State(settings, trainer.accelerator.device.type)
    trainer._zorro = st
    reason = _start_checks(trainer)
    if reason is not None:
        st.refuse(reason)
        st.unsupported = reason
    elif getattr(settings, "micro_batch_order", "stock") == "groups":
        why = group_order_unsupported(trainer.args)
        if why is not None:
            st.refuse(why)  # under warn: TRL's own row order, still deduplicated
        st.group_order = why is None


def _init(self, stock, *args, zorro: Any = None, **kwargs) -> None:
    settings = trl_settings(zorro) if zorro is not None or _enabled is None else trl_settings(_enabled)
    stock(*args, **kwargs)
    _setup(self, settings)


def _install(st: _State, model, sharded: bool = False) -> None:
    """Install zorro on ``model`` (unwrapped) once; the first install runs the probe (every layer dispatches) unless
    the model is sharded (FSDP / DeepSpeed: the probe would call submodules outside the root's forward, as in verl's
    engines; every packed forward is checked anyway)."""
    if is_installed(model):
        return
    install_zorro(model, probe=id(model) not in st.probed and not sharded)
    st.probed.add(id(model))
    if all(m is not model for m in st.installed):
        st.installed.append(model)


def _count(trainer, ordinary: int, packed: int, fallback: int) -> None:
    metrics = getattr(trainer, "_metrics", None)
    if metrics is None:
        return
    mode = "train" if trainer.model.training else "eval"
    m = metrics[mode]
    m["zorro/fallbacks"].append(float(fallback))
    if packed:
        m["zorro/dedup_ratio"].append(ordinary / packed)
        m["zorro/prompt_tokens_saved"].append(float(ordinary - packed))


def _hf_model(model):
    """The transformers model under a PEFT wrapper (``get_rope_index`` and the config live there)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _media_unsupported(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, media: dict) -> Optional[str]:
    """Why this call's multimodal inputs cannot run through zorro's media plan (None when they can, or when there
    are none). ``model``: the unwrapped policy / reference; ``input_ids`` / ``attention_mask`` ``[B, S]``;
    ``media``: the seam's multimodal keywords."""
    present = [k for k in _MEDIA_KEYS if media.get(k) is not None]
    other = [k for k in present if k not in _QWEN_MEDIA_KEYS]
    hf = _hf_model(model)
    if other:
        return (f"zorro for TRL: multimodal inputs ({', '.join(other)}) of this model family are not supported; "
                "zorro's media plan takes the Qwen2-VL family's images (pixel_values, image_grid_thw, num_images)")
    if not is_multimodal(hf):
        present = [k for k in present if k != "num_images"]  # stock ignores the counts without images
        if present:
            return (f"zorro for TRL: multimodal inputs ({', '.join(present)}) with a text-only model "
                    f"({type(hf).__name__}: no config.vision_config); nothing would encode the images")
        return None
    if not isinstance(getattr(hf.config.vision_config, "spatial_merge_size", None), int):
        return (f"zorro for TRL: {type(hf).__name__}'s vision tower is not of the Qwen2-VL family (no "
                "vision_config.spatial_merge_size); zorro's media plan supports Qwen2-VL, Qwen2.5-VL, Qwen3-VL, "
                "Qwen3.5")
    if media.get("pixel_values") is not None and (media.get("image_grid_thw") is None
                                                  or media.get("num_images") is None):
        return ("zorro for TRL: pixel_values without image_grid_thw and num_images (the rows' image counts); "
                "zorro's media plan needs both to give each row its own images")
    mm = media.get("mm_token_type_ids")
    if mm is not None:
        want = token_types(input_ids, media_tokens(hf)).to(mm.device)
        if bool((mm.to(want.dtype) != want)[attention_mask.bool()].any()):
            # TRL zeroes them (and drops the images) when a completion truncated an image's placeholders: the
            # placeholders then run as text, which zorro's media plan does not reproduce
            return ("zorro for TRL: mm_token_type_ids disagree with the image / video placeholder tokens of "
                    "input_ids (TRL drops a batch's images when a completion truncated an image's placeholders); "
                    "raise max_completion_length so that no image is cut")
    return None


def _row_media(media: dict, start: int, end: int) -> list:
    """Rows ``start..end-1``'s images as zorro's media plan takes them: per row ``{pixel_values [n_b, C],
    image_grid_thw [k_b, 3]}`` (its images in placeholder order) or None. TRL's ``pixel_values`` concatenates every
    row's image patches (``t*h*w`` patch rows per ``image_grid_thw`` row, one row per image), ``num_images`` (host
    list) counts each row's images."""
    pix, grid, num = media.get("pixel_values"), media.get("image_grid_thw"), media.get("num_images")
    if pix is None:
        return [None] * (end - start)
    patches = grid.long().prod(-1).tolist()
    img0 = sum(num[:start])
    row0 = sum(patches[:img0])
    out = []
    for b in range(start, end):
        k = num[b]
        n = sum(patches[img0:img0 + k])
        out.append({"pixel_values": pix[row0:row0 + n], "image_grid_thw": grid[img0:img0 + k]} if k else None)
        img0, row0 = img0 + k, row0 + n
    return out


def _get_per_token_logps_and_entropies(self, stock, model, input_ids, attention_mask, logits_to_keep,
                                       batch_size=None, compute_entropy=False, compute_aux_loss=False, **media):
    """zorro's version of the seam: same arguments and returns as TRL's (``logps [B, C]`` fp32, ``entropies
    [B, C] | None``, ``aux_loss`` None); 0 on pad positions."""
    st: Optional[_State] = getattr(self, "_zorro", None)
    reason = None
    if st is None:
        return stock(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                     compute_aux_loss, **media)
    if st.unsupported is not None:
        reason = st.unsupported
    elif compute_aux_loss:
        reason = ("zorro for TRL: the MoE router auxiliary loss (compute_aux_loss, model.config.output_router_logits)"
                  " is computed per token of the ordinary rows; set output_router_logits=False")
    else:
        reason = _media_unsupported(self.accelerator.unwrap_model(model), input_ids, attention_mask, media)
    if reason is not None:
        st.refuse(reason)  # raises under on_unsupported=raise
        base = self.accelerator.unwrap_model(model)
        if is_installed(base):  # stays off until the next deduplicated call (covers this call's backward)
            uninstall_zorro(base)
        _count(self, 0, 0, 1)
        return stock(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                     compute_aux_loss, **media)
    # stays installed through backward: gradient checkpointing recomputes the layers there
    kind = str(getattr(self.accelerator, "distributed_type", ""))
    _install(st, self.accelerator.unwrap_model(model), sharded="FSDP" in kind or "DEEPSPEED" in kind)
    batch_size = batch_size or input_ids.size(0)
    plan_kwargs = st.settings.plan_kwargs()
    hf = _hf_model(self.accelerator.unwrap_model(model))
    vlm = is_multimodal(hf)
    logps, ents, ordinary, packed, row_items, items = [], [], 0, 0, 0, 0
    for s in range(0, input_ids.size(0), batch_size):  # stock's row chunks
        ids, am = input_ids[s:s + batch_size], attention_mask[s:s + batch_size]
        packed_media = None
        if vlm:
            rows = _row_media(media, s, s + ids.size(0))
            # the positions the model's own forward computes for these rows (get_rope_index on the attention mask)
            pos = rope_positions(hf, ids, am, rows)
            plan, packed_media = build_media_plan(ids, am, logits_to_keep, rows, media_tokens(hf), pos,
                                                  **plan_kwargs)
            row_items, items = row_items + packed_media.row_items, items + packed_media.items
        else:
            plan = build_plan(ids, am, logits_to_keep, **plan_kwargs)
        ordinary, packed = ordinary + plan.ordinary_tokens, packed + plan.T
        with self.accelerator.autocast():
            # TRL's fused head applies the temperature as z.float() * (1 / T): zorro's "upcast" order
            lp, ent = zorro_step(model, plan, backend=st.backend, temperature=self.temperature,
                                 calculate_entropy=compute_entropy, temperature_op="upcast",
                                 logits_optimization=st.settings.logits_optimization, media=packed_media)
        logps.append(plan.to_padded(lp))
        if compute_entropy:
            ents.append(plan.to_padded(ent))
    metrics = getattr(self, "_metrics", None)
    if items and metrics is not None:  # the vision tower's saving: images of the ordinary rows / images encoded
        metrics["train" if self.model.training else "eval"]["zorro/media_dedup_ratio"].append(row_items / items)
    _count(self, ordinary, packed, 0)
    return torch.cat(logps), (torch.cat(ents) if compute_entropy else None), None


def _generate(self, stock, *args, **kwargs):
    """Rollouts: HF ``generate`` runs the policy module itself, so zorro is off for it and back on after."""
    st: Optional[_State] = getattr(self, "_zorro", None)
    off = [m for m in (st.installed if st is not None else []) if is_installed(m)]
    for m in off:
        uninstall_zorro(m)
    try:
        return stock(*args, **kwargs)
    finally:
        for m in off:
            install_zorro(m, probe=False)


def _train(self, stock, *args, **kwargs):
    """Stock's ``train``; afterwards every model is handed back with its own attention (a later ``generate``,
    evaluation or ``save_pretrained`` outside the trainer sees the stock model)."""
    try:
        return stock(*args, **kwargs)
    finally:
        st: Optional[_State] = getattr(self, "_zorro", None)
        for m in (st.installed if st is not None else []):
            if is_installed(m):
                uninstall_zorro(m)


_IMPL = {"__init__": _init, "_get_per_token_logps_and_entropies": _get_per_token_logps_and_entropies,
         "_generate": _generate, "_prepare_inputs": _prepare_inputs, "train": _train}


def _method(name: str):
    impl, stock = _IMPL[name], _STOCK[name]

    @functools.wraps(stock)
    def method(self, *args, **kwargs):
        return impl(self, stock.__get__(self), *args, **kwargs)

    method._zorro = True
    return method


class ZorroGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` with zorro's deduplicated log-prob step.

    Takes GRPOTrainer's arguments plus ``zorro``: a dict of :data:`~zorro_verl.integrations.trl.settings.TRL_KEYS`
    (``attention_backend``, ``logits_optimization``, ``sharing``, ``min_shared_len``, ``on_unsupported``) or a
    :class:`ZorroSettings`; None = the settings given to :func:`enable`, else the defaults.
    """


for _name in _METHODS:
    setattr(ZorroGRPOTrainer, _name, _method(_name))


def enable(settings: Optional[Any] = None, **keys) -> ZorroSettings:
    """Switch every ``trl.GRPOTrainer`` created from now on to zorro (patches the class; one line at the top of an
    existing script). ``settings`` / ``keys``: as :class:`ZorroGRPOTrainer`'s ``zorro``. Returns the settings."""
    global _enabled
    _enabled = trl_settings(settings, **keys)
    check_trl_version(_enabled.on_unsupported)
    for name in _METHODS:
        setattr(GRPOTrainer, name, _method(name))
    return _enabled


def disable() -> None:
    """Undo :func:`enable`: ``trl.GRPOTrainer`` is stock again (trainers already built keep their zorro state)."""
    global _enabled
    _enabled = None
    for name in _METHODS:
        if name in _OWN:
            setattr(GRPOTrainer, name, _STOCK[name])
        elif name in GRPOTrainer.__dict__:
            delattr(GRPOTrainer, name)


def is_enabled() -> bool:
    """Whether :func:`enable` patched ``trl.GRPOTrainer``."""
    return _enabled is not None
