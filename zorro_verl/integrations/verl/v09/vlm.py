"""Vision-language models in the zorro engine: transformers' own forwards on the engine's model, and the vision
tower's collectives on micro-batches without images (docs/design/verl.md "Vision-language models in the 0.9 engine").

verl's ``apply_monkey_patch`` (run when an engine builds its model) replaces methods **on the classes** of the
Qwen-VL families: the top-level forward (``forward_with_normal_backend``: the head on every position, no
``logits_to_keep``), the ``*Model`` forward (its own embedding merge; ``position_ids`` must be ``[4, B, S]``), and
with remove-padding Qwen2/2.5-VL's text attention (a flash-attn varlen call that never reaches transformers'
attention interface, so never zorro's). The zorro engine runs its own model's instances on transformers' methods:
:func:`use_transformers_methods` sets, per module instance, each method verl replaced back to the one transformers
defines (captured when this module is imported, before any engine builds a model); other engines of the process
keep verl's. :func:`restore_verl_methods` undoes it (the stock fallback).

A micro-batch without images runs no vision tower in transformers' forward; under FSDP the other ranks' towers
would then wait for this rank's all-gathers. As verl's patched forward does, :func:`run_idle_tower` runs the tower on
a dummy 4x4-patch image and adds ``0 * mean`` of its output to the language model's input (exact: adds zero).
"""

from __future__ import annotations

import importlib
import types

import torch

__all__ = ["VLM_MODULES", "use_transformers_methods", "restore_verl_methods", "run_idle_tower"]

#: transformers modules of the vision-language families whose classes verl patches.
VLM_MODULES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")


def _capture() -> dict:
    """``{class: {name: function}}`` of every method the VLM classes define, as transformers defines them."""
    out: dict = {}
    for name in VLM_MODULES:
        try:
            mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except ImportError:  # an older transformers without this family
            continue
        for obj in vars(mod).values():
            if isinstance(obj, type) and issubclass(obj, torch.nn.Module) and obj.__module__ == mod.__name__:
                out[obj] = {k: v for k, v in vars(obj).items() if isinstance(v, types.FunctionType)}
    return out


_ORIGINALS = _capture()
_SET = "_zorro_transformers_methods"


def _originals_of(cls) -> dict:
    for base in cls.__mro__:  # FSDP2 makes a subclass per instance: its base is transformers' class
        if base in _ORIGINALS:
            return _ORIGINALS[base]
    return {}


def use_transformers_methods(model) -> int:
    """Give every submodule of ``model`` transformers' own version of each method its class has replaced (verl's
    class patches), as an instance attribute; returns how many were set. Raises if this module was imported after
    verl had patched the classes (the captured methods would be verl's)."""
    count = 0
    for sub in model.modules():
        for name, orig in _originals_of(type(sub)).items():
            if orig.__module__.startswith("verl."):
                raise RuntimeError("zorro: verl patched the vision-language model classes before zorro_verl's engine "
                                   "was imported, so transformers' own forwards are lost. Load zorro's plugin at "
                                   "`import verl` (the zorro_verl entry point / VERL_USE_EXTERNAL_MODULES).")
            current = getattr(type(sub), name, None)
            if current is orig or name in vars(sub):
                continue
            setattr(sub, name, types.MethodType(orig, sub))
            sub.__dict__.setdefault(_SET, []).append(name)
            count += 1
    return count


def restore_verl_methods(model) -> None:
    """Undo :func:`use_transformers_methods`: the instances run their classes' (verl-patched) methods again."""
    for sub in model.modules():
        for name in sub.__dict__.pop(_SET, []):
            sub.__dict__.pop(name, None)


def run_idle_tower(model, inputs_embeds: torch.Tensor) -> torch.Tensor:
    """``inputs_embeds + 0 * mean(tower(dummy image))``: the vision tower's parameters take part in the forward and
    backward of a micro-batch without images, as on the ranks whose micro-batch has some. ``model``: the module
    that owns ``visual`` (the ``*Model`` of a ``*ForConditionalGeneration``)."""
    cfg = model.config.vision_config
    patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    visual = model.visual
    pixels = torch.zeros((16, patch_dim), dtype=inputs_embeds.dtype, device=inputs_embeds.device)
    grid = torch.tensor([[1, 4, 4]], dtype=torch.long, device=inputs_embeds.device)
    out = visual(pixels, grid_thw=grid)
    feats = getattr(out, "pooler_output", None)
    if feats is None:
        feats = out[0] if isinstance(out, (tuple, list)) else out
    if isinstance(feats, (tuple, list)):
        feats = torch.cat(list(feats))
    return inputs_embeds + 0.0 * feats.mean()
