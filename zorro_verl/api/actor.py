"""The reference API's actor: ``DeduplicatedActor`` and the patcher it installs, ``Qwen3ModelOncePatcher``
(docs/design/api.md).

Despite its name the patcher serves every decoder whose attention dispatches through transformers'
``ALL_ATTENTION_FUNCTIONS``; it installs the ``"zorro"`` attention once and builds a fresh plan per micro-batch, so
one patcher serves micro-batches of any shape, response width and temperature.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from zorro_verl.api.loss import packed_ppo_policy_loss
from zorro_verl.attention import BACKEND_NAMES, get_backend
from zorro_verl.integrations.transformers import install_zorro, is_installed, load_causal_lm, zorro_step
from zorro_verl.integrations.transformers.vision import is_multimodal
from zorro_verl.logprob import check_logits_optimization
from zorro_verl.packing import ZorroPlan, build_plan
from zorro_verl.packing.microbatch import dynamic_microbatches
from zorro_verl.packing.multimodal import IGNORED_MEDIA_KEYS, MEDIA_FIELDS, MediaTokens, placeholder_counts
from zorro_verl.packing.tree import DEFAULT_MIN_SHARED_LEN, check_min_shared_len, check_sharing, tree_row_costs

__all__ = ["DeduplicatedActor", "Qwen3ModelOncePatcher", "ModelOutput", "backend_for"]

logger = logging.getLogger(__name__)

_REQUIRED = ("input_ids", "attention_mask", "responses")
_TRAINING = ("old_log_probs", "advantages")
#: Multimodal keys of a batch (per-row fields and verl's per-row dicts): the API takes none of them.
_MEDIA_KEYS = tuple(f for pair in MEDIA_FIELDS.values() for f in pair) + IGNORED_MEDIA_KEYS + ("multi_modal_inputs",)
_LOWER_LEVEL = ("for a vision-language batch use the lower-level path: vision.rope_positions + "
                "packing.multimodal.build_media_plan + zorro_step(model, plan, media=...)")


#: The API's ``attn_implementation`` names the kernel zorro uses inside its split attention.
_KERNEL_TO_BACKEND = {
    "eager": "eager",
    "sdpa": "sdpa",
    "flash_attention_2": "flash",
    "flash_attention_3": "flash",
    "flex_attention": "flex",
}


def backend_for(attn_implementation: str, use_split_attention: bool = True,
                attention_backend: Optional[str] = None) -> str:
    """The attention backend of the API's arguments: ``attention_backend`` (any registered name) when given, else
    ``standard`` without split attention, else the backend of ``attn_implementation``'s kernel."""
    if attention_backend is not None:
        return get_backend(attention_backend).name  # ValueError naming the registered backends
    if attn_implementation not in _KERNEL_TO_BACKEND:
        raise ValueError(f"attn_implementation: expected one of {sorted(_KERNEL_TO_BACKEND)}, got "
                         f"{attn_implementation!r} (or pass attention_backend= one of {list(BACKEND_NAMES)}).")
    if not use_split_attention:
        return "standard"
    return _KERNEL_TO_BACKEND[attn_implementation]


@dataclass
class ModelOutput:
    """Output of :meth:`DeduplicatedActor.forward`.

    * ``logprobs [N]`` and ``entropy [N]`` (``None`` unless asked): fp32 (fp64 for fp64 models), one entry per valid
      response token, original row order; differentiable in train mode.
    * ``plan``: the micro-batch's plan (``plan.to_padded(x)`` gives verl's ``[B, R]`` layout).
    """

    logprobs: torch.Tensor
    entropy: Optional[torch.Tensor]
    plan: ZorroPlan

    def __getitem__(self, key):
        return getattr(self, key)


def _check_batch(micro_batch, need_training: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
    if not isinstance(micro_batch, dict):
        raise TypeError(f"micro_batch: expected a dict of tensors, got {type(micro_batch).__name__}.")
    keys = _REQUIRED + (_TRAINING if need_training else ())
    missing = [k for k in keys if k not in micro_batch]
    if missing:
        raise ValueError(f"micro_batch: missing keys {missing}; expected at least {list(keys)} (verl layout).")
    ids, mask, resp = micro_batch["input_ids"], micro_batch["attention_mask"], micro_batch["responses"]
    for name, t in (("input_ids", ids), ("attention_mask", mask), ("responses", resp)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"micro_batch[{name!r}]: expected a 2-D tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}.")
    if resp.shape[0] != ids.shape[0]:
        raise ValueError(f"micro_batch['responses']: expected {ids.shape[0]} rows (as input_ids), got {resp.shape[0]}.")
    R = resp.shape[1]
    if R >= ids.shape[1]:
        raise ValueError(f"micro_batch['responses']: response width {R} must be smaller than the sequence width "
                         f"{ids.shape[1]} of input_ids (which holds prompt + response).")
    for name in ("response_mask",) + (_TRAINING + ("ref_log_prob",) if need_training else ()):
        t = micro_batch.get(name)
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != (ids.shape[0], R)):
            raise ValueError(f"micro_batch[{name!r}]: expected shape [{ids.shape[0]}, {R}] ([B, R]), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}.")
    return ids, mask, R


def _check_text_batch(model, micro_batch, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """The API runs text batches: ValueError for multimodal keys (they would be dropped) and, on a vision-language
    model, for image / video placeholder tokens (the model would embed them as text: no features, 1-D positions).
    One host read per placeholder kind, vision-language models only."""
    given = [k for k in _MEDIA_KEYS if micro_batch.get(k) is not None]
    if given:
        raise ValueError(f"micro_batch: multimodal inputs {given} are not taken by DeduplicatedActor (it runs text "
                         f"batches and would drop them); {_LOWER_LEVEL}.")
    if not is_multimodal(model):
        return
    # the placeholder ids only (not vision.media_tokens, which refuses towers outside the Qwen2-VL family: their
    # text batches run here)
    cfg = model.config
    tokens = MediaTokens(getattr(cfg, "image_token_id", None), getattr(cfg, "video_token_id", None), 1)
    for kind, counts in placeholder_counts(ids, mask, tokens).items():
        for b, n in enumerate(counts):
            if n:
                pix_field, grid_field = MEDIA_FIELDS[kind]
                raise ValueError(f"micro_batch['input_ids']: row {b} has {n} {kind} placeholder tokens (id "
                                 f"{tokens.token_id(kind)}) but no {grid_field}/{pix_field}: DeduplicatedActor "
                                 f"takes no media, so remove the placeholders, or {_LOWER_LEVEL}.")


class Qwen3ModelOncePatcher:
    """Installs the deduplicated forward on a model once; builds one plan per micro-batch.

    ``response_len``, ``rollout_n`` and ``temperature`` are defaults and expectations, never frozen: every call
    may pass its own response width (from the batch) and temperature. ``rollout_n`` is the expected group size;
    groups smaller than it in a micro-batch are counted in ``split_groups`` of :meth:`stats`.
    """

    def __init__(self, model, response_len: int, rollout_n: int, temperature: float, *, backend: str = "sdpa",
                 logits_optimization: str = "none", sharing: str = "prompt", min_shared_len: Optional[int] = None):
        self.model = model
        self.set_defaults(response_len, rollout_n, temperature)
        self.backend = get_backend(backend).name
        self.logits_optimization = check_logits_optimization(logits_optimization)
        self.plan_kwargs = _plan_kwargs(sharing, min_shared_len)
        install_zorro(model)

    def set_defaults(self, response_len: int, rollout_n: int, temperature: float) -> None:
        """Validate and store the per-call defaults."""
        for name, v, low in (("response_len", response_len, 0), ("rollout_n", rollout_n, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {v!r}.")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
            raise ValueError(f"temperature: expected a float > 0, got {temperature!r}.")
        self.response_len, self.rollout_n, self.temperature = response_len, rollout_n, float(temperature)

    @property
    def installed(self) -> bool:
        return is_installed(self.model)

    def plan(self, micro_batch: Dict[str, torch.Tensor]) -> ZorroPlan:
        """Build the micro-batch's plan (the only host syncs of the step happen here)."""
        ids, mask, R = _check_batch(micro_batch)
        _check_text_batch(self.model, micro_batch, ids, mask)
        return build_plan(ids, mask, R, position_ids=micro_batch.get("position_ids"), **self.plan_kwargs)

    def forward(self, micro_batch: Dict[str, torch.Tensor], temperature: Optional[float] = None,
                calculate_entropy: bool = False) -> ModelOutput:
        plan = self.plan(micro_batch)
        lp, ent = zorro_step(self.model, plan, backend=self.backend,
                             temperature=self.temperature if temperature is None else temperature,
                             calculate_entropy=calculate_entropy, logits_optimization=self.logits_optimization)
        return ModelOutput(lp, ent, plan)

    def stats(self, plan: ZorroPlan) -> Dict[str, float]:
        """Dedup metrics of one plan: ratio of ordinary to packed tokens, prompt tokens saved, split groups (prefix
        trees: clusters), and for prefix trees ``zorro/tree_depth`` (node levels of the deepest path)."""
        out = {
            "zorro/dedup_ratio": plan.ordinary_tokens / max(plan.T, 1),
            "zorro/prompt_tokens_saved": float(plan.ordinary_tokens - plan.T),
            "zorro/split_groups": float((plan.group_sizes < self.rollout_n).sum()),
        }
        if plan.tree is not None:
            out["zorro/tree_depth"] = float(plan.tree.levels)
        return out


def _plan_kwargs(sharing: str, min_shared_len: Optional[int]) -> dict:
    """Validated ``build_plan`` keywords of the API's ``sharing`` / ``min_shared_len``."""
    if check_sharing(sharing) == "prefix":
        return {"sharing": "prefix", "min_shared_len": check_min_shared_len(
            DEFAULT_MIN_SHARED_LEN if min_shared_len is None else min_shared_len)}
    if min_shared_len is not None:
        raise ValueError(f"min_shared_len: only used with sharing='prefix', got {min_shared_len!r} with "
                         "sharing='prompt'. Drop it or pass sharing='prefix'.")
    return {"sharing": "prompt"}


class DeduplicatedActor:
    """A causal LM whose log-prob / entropy / policy-loss passes compute each unique prompt once per micro-batch.

    Args:
        model_name_or_path: a Hugging Face model id or a local directory (``save_pretrained`` output).
        device: ``"cuda"``, ``"cpu"``, ``"cuda:1"``...
        logits_optimization: ``none | compute | memory`` (see :mod:`zorro_verl.logprob`).
        use_split_attention: ``True`` = split attention; ``False`` = "standard QKV" (dedup projections, K/V
            expanded to full rows, one ordinary causal call).
        attn_implementation: the kernel inside zorro: ``eager``/``sdpa`` (reference), ``flash_attention_2``/``_3``
            (flash varlen, CUDA), ``flex_attention``.
        world_size: data-parallel world size this actor runs in (must match ``torch.distributed`` when > 1).
        max_token_len: token budget of one forward; a micro-batch whose deduplicated row is longer is processed in
            chunks of whole prompt groups (each prompt still computed once per chunk; a group larger than the
            budget forms a chunk of its own), packed as verl's dynamic micro-batches are.
        dtype: parameter dtype.
        attention_backend: (keyword only, beyond the reference signature) any registered attention backend, e.g.
            ``flash_copyfree``; overrides ``attn_implementation`` / ``use_split_attention``.
        sharing: (keyword only, beyond the reference signature) ``"prompt"`` (rows with identical prompts share
            them) or ``"prefix"`` (every common prefix: the prefix tree, docs/design/math.md).
        min_shared_len: (keyword only) ``sharing="prefix"``: tokens a shared tree node must add over its parent
            (default 64).
    """

    def __init__(
        self,
        model_name_or_path: str,
        device: str = "cuda",
        logits_optimization: str = "none",
        use_split_attention: bool = True,
        attn_implementation: str = "eager",
        world_size: int = 1,
        max_token_len: int = 4096,
        dtype: torch.dtype = torch.bfloat16,
        *,
        attention_backend: Optional[str] = None,
        sharing: str = "prompt",
        min_shared_len: Optional[int] = None,
    ):
        check_logits_optimization(logits_optimization)
        self.plan_kwargs = _plan_kwargs(sharing, min_shared_len)
        if not isinstance(use_split_attention, bool):
            raise TypeError(f"use_split_attention: expected a bool, got {type(use_split_attention).__name__}.")
        self.backend = backend_for(attn_implementation, use_split_attention, attention_backend)
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size: expected an int >= 1, got {world_size!r}.")
        if world_size > 1:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size):
                raise ValueError(f"world_size: {world_size} requires an initialized torch.distributed group of that "
                                 "size; initialize it first or pass world_size=1.")
        if isinstance(max_token_len, bool) or not isinstance(max_token_len, int) or max_token_len < 1:
            raise ValueError(f"max_token_len: expected an int >= 1, got {max_token_len!r}.")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype: expected a floating torch.dtype, got {dtype!r}.")
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: 'cuda' requested but CUDA is not available; pass device='cpu'.")
        if dev.type not in get_backend(self.backend).device_types:
            raise ValueError(f"attention backend {self.backend!r} (attn_implementation={attn_implementation!r}) needs "
                             f"a CUDA device, got {device!r}; use 'sdpa' or 'eager' on CPU.")
        if not isinstance(model_name_or_path, str):
            raise TypeError(f"model_name_or_path: expected a str (hub id or local directory), got "
                            f"{type(model_name_or_path).__name__}; use DeduplicatedActor.from_model for a module.")
        model = load_causal_lm(model_name_or_path, dtype=dtype, device=dev)
        self._setup(model, dev, logits_optimization, world_size, max_token_len)

    @classmethod
    def from_model(cls, model, *, logits_optimization: str = "none", use_split_attention: bool = True,
                   attn_implementation: str = "sdpa", world_size: int = 1, max_token_len: int = 4096,
                   attention_backend: Optional[str] = None, sharing: str = "prompt",
                   min_shared_len: Optional[int] = None) -> "DeduplicatedActor":
        """Wrap an already built ``*ForCausalLM`` (e.g. from a config) instead of loading one."""
        check_logits_optimization(logits_optimization)
        self = cls.__new__(cls)
        self.plan_kwargs = _plan_kwargs(sharing, min_shared_len)
        self.backend = backend_for(attn_implementation, use_split_attention, attention_backend)
        self._setup(model, next(model.parameters()).device, logits_optimization, world_size, max_token_len)
        return self

    def _setup(self, model, device, logits_optimization, world_size, max_token_len):
        self.model = model
        self.device = device
        self.logits_optimization = logits_optimization
        self.world_size = world_size
        self.max_token_len = max_token_len
        self.clip_ratio = 0.2
        self.kl_loss_coef = 0.001
        self._patcher: Optional[Qwen3ModelOncePatcher] = None

    # ------------------------------------------------------------------ API
    def patch(self, response_len: int, rollout_n: int, temperature: float) -> Qwen3ModelOncePatcher:
        """Install the deduplicated forward (once); later calls update the defaults and return the same patcher."""
        if self._patcher is None:
            self._patcher = Qwen3ModelOncePatcher(self.model, response_len, rollout_n, temperature,
                                                  backend=self.backend, logits_optimization=self.logits_optimization,
                                                  **self.plan_kwargs)
        else:
            self._patcher.set_defaults(response_len, rollout_n, temperature)
        return self._patcher

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()

    def _ensure_patched(self, micro_batch, temperature) -> Qwen3ModelOncePatcher:
        if self._patcher is None:
            self.patch(micro_batch["responses"].shape[1], 1, temperature)
        return self._patcher

    def _chunks(self, plan: ZorroPlan, micro_batch) -> list:
        """Row-index chunks of whole groups (prefix trees: clusters) whose packed length fits ``max_token_len``
        (``[None]``: one chunk)."""
        if plan.T <= self.max_token_len or plan.G == 1:
            return [None]
        if plan.tree is not None:
            ids, mask, R = _check_batch(micro_batch)
            tc = tree_row_costs(ids, mask if mask is not None else torch.ones_like(ids), R,
                                self.plan_kwargs["min_shared_len"])
            mbs = dynamic_microbatches(tc["cluster"], tc["root_len"], tc["own"], self.max_token_len,
                                       split_oversized_groups=False)
            return [torch.tensor(rows, device=plan.device) for rows in mbs.batches]
        mbs = dynamic_microbatches(plan.row_group, plan.row_prompt_lens, plan.response_lens, self.max_token_len,
                                   split_oversized_groups=False)
        return [torch.tensor(rows, device=plan.device) for rows in mbs.batches]

    def forward(self, micro_batch: Dict[str, torch.Tensor], temperature: float = 1.0,
                calculate_entropy: bool = False) -> ModelOutput:
        """Log-probs (and entropy) of every valid response token: ``[N]`` each, original row order.

        ``micro_batch`` (verl layout): ``input_ids [B, S] int64`` (left-padded prompt + right-padded response),
        ``attention_mask [B, S]``, ``responses [B, R]``, optional ``position_ids [B, S]``.
        """
        _check_batch(micro_batch)
        patcher = self._ensure_patched(micro_batch, temperature)
        plan = patcher.plan(micro_batch)
        chunks = self._chunks(plan, micro_batch)
        if chunks == [None]:
            lp, ent = zorro_step(self.model, plan, backend=self.backend, temperature=temperature,
                                 calculate_entropy=calculate_entropy, logits_optimization=self.logits_optimization)
            return ModelOutput(lp, ent, plan)
        lp_pad = ent_pad = None
        for rows in chunks:
            sub = {k: v[rows] for k, v in micro_batch.items() if isinstance(v, torch.Tensor)}
            out = patcher.forward(sub, temperature, calculate_entropy)
            p_lp = out.plan.to_padded(out.logprobs)
            lp_pad = p_lp.new_zeros(plan.B, plan.R).index_copy(0, rows, p_lp) if lp_pad is None else \
                lp_pad.index_copy(0, rows, p_lp)
            if calculate_entropy:
                p_en = out.plan.to_padded(out.entropy)
                ent_pad = p_en.new_zeros(plan.B, plan.R).index_copy(0, rows, p_en) if ent_pad is None else \
                    ent_pad.index_copy(0, rows, p_en)
        return ModelOutput(plan.from_padded(lp_pad), plan.from_padded(ent_pad) if calculate_entropy else None, plan)

    def compute_policy_loss_and_backward(self, micro_batch: Dict[str, torch.Tensor], temperature: float = 1.0,
                                         gradient_accumulation: int = 1) -> Dict[str, float]:
        """PPO loss on the tokens with ``response_mask == 1`` (all valid tokens without it), then ``backward`` of
        ``loss / gradient_accumulation``. Needs ``old_log_probs`` and ``advantages`` ``[B, R]`` (``ref_log_prob``
        adds the KL term). Returns float metrics incl. ``actor/policy_loss`` and the ``zorro/*`` dedup metrics."""
        _check_batch(micro_batch, need_training=True)
        if isinstance(gradient_accumulation, bool) or not isinstance(gradient_accumulation, int) or \
                gradient_accumulation < 1:
            raise ValueError(f"gradient_accumulation: expected an int >= 1, got {gradient_accumulation!r}.")
        out = self.forward(micro_batch, temperature=temperature, calculate_entropy=False)
        plan = out.plan
        sel = plan.from_padded(micro_batch["response_mask"]).bool() if "response_mask" in micro_batch else None
        pick = (lambda t: plan.from_padded(t)[sel]) if sel is not None else plan.from_padded
        ref = micro_batch.get("ref_log_prob")
        lp = out.logprobs[sel] if sel is not None else out.logprobs
        loss, metrics = packed_ppo_policy_loss(lp, pick(micro_batch["old_log_probs"]), pick(micro_batch["advantages"]),
                                               pick(ref) if ref is not None else None, clip_ratio=self.clip_ratio,
                                               kl_loss_coef=self.kl_loss_coef)
        (loss / gradient_accumulation).backward()
        metrics.update(self._patcher.stats(plan))
        return metrics
