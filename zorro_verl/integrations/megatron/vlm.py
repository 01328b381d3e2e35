"""Vision-language models on zorro's Megatron step: Megatron-Bridge's ``Qwen25VLModel`` (docs/design/megatron.md
"Vision-language models").

Megatron-Bridge builds Qwen2.5-VL as a ``Qwen25VLModel``: transformers' vision tower (``visual``) beside a
megatron-core ``GPTModel`` (``language_model``, ``position_embedding_type = "mrope"``). Its forward embeds the ids,
runs the tower on ``pixel_values`` / ``image_grid_thw`` (and videos), scatters the features over the placeholder
tokens, computes the 3-D rotary positions with transformers' ``get_rope_index`` from the ids and grids, and calls the
language model with them as ``decoder_input`` / ``position_ids``.

zorro runs that forward unchanged on the packed row (:class:`VlmCall`), with the packed row's media (each unique
prompt's images once, each response's own: :func:`~zorro_verl.packing.multimodal.pack_media`) as its inputs, so the
tower encodes each unique image once and the model's own merge scatters the features. Two things of the call are
zorro's, for the call only (instance attributes, removed on exit):

* ``get_rope_index`` returns the packed row's 3-D positions ``[3, 1, Tp]`` (each token's triple in its ordinary row,
  read from the rows' own ``get_rope_index`` positions and checked equal across a shared prompt): run on the packed
  row it would number the responses after one another;
* ``language_model.forward`` gets zorro's ``packed_seq_params`` (the plan, for the layers' zorro core attention) and
  its ``output_processor`` (the head at the response-predicting rows).

megatron's ``MultimodalRotaryEmbedding`` computes each token's table from its own triple, so the positions need no
table lookup (unlike 1-D RoPE, :class:`~zorro_verl.integrations.megatron.attention.PositionedRope`).
Imports megatron-core only (the bridge's class is recognised by name: importing ``megatron.bridge`` is not needed).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["VLM_CLASSES", "find_vlm_model", "vlm_unsupported", "VlmCall"]

#: The vision-language model classes zorro's Megatron step runs: (module, class name).
VLM_CLASSES = (("megatron.bridge.models.qwen_vl.modeling_qwen25_vl", "Qwen25VLModel"),)


def _is_vlm(m) -> bool:
    return (type(m).__module__, type(m).__name__) in VLM_CLASSES


def find_vlm_model(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The ``Qwen25VLModel`` inside ``model`` (itself, or under megatron's ``.module`` wrappers: DDP,
    Float16Module), else None."""
    m = model
    for _ in range(8):
        if _is_vlm(m):
            return m
        m = getattr(m, "module", None)
        if m is None:
            break
    return None


def vlm_unsupported(vlm: torch.nn.Module) -> Optional[str]:
    """Why zorro cannot run the vision-language model ``vlm`` (a ``Qwen25VLModel``) exactly, or None: the
    parallelism it has been checked under is one rank per model (no tensor, pipeline or context parallelism)."""
    cfg = vlm.config
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        v = getattr(cfg, name, 1) or 1
        if v != 1:
            return (f"{name}={v} with a vision-language model on zorro's Megatron engine: the vision tower, the "
                    "embedding merge and the 3-D positions of the packed row are checked against the stock engine "
                    f"at {name}=1 only; set {name}=1 or run this job without zorro")
    if getattr(cfg, "virtual_pipeline_model_parallel_size", None) not in (None, 1):
        return ("virtual pipeline stages with a vision-language model on zorro's Megatron engine: not checked; "
                "unset virtual_pipeline_model_parallel_size or run this job without zorro")
    if not (vlm.pre_process and vlm.post_process):
        return ("pipeline stages (pre_process / post_process split) with a vision-language model on zorro's Megatron "
                "engine: zorro's step runs it whole on one rank; set pipeline_model_parallel_size=1")
    return None


class VlmCall:
    """For one forward of the ``Qwen25VLModel`` ``vlm`` on a zorro packed row (see module docstring):
    ``get_rope_index`` returns ``positions [3, 1, Tp] int64`` (checked: the call's ids are ``[1, Tp]``) and
    ``language_model.forward`` runs with ``packed_seq_params`` and, when given, ``output_processor``.
    :attr:`rope_calls` counts the position calls (one per forward)."""

    def __init__(self, vlm: torch.nn.Module, positions: torch.Tensor, packed_seq_params, output_processor=None):
        if positions.dim() != 3 or positions.shape[:2] != (3, 1):
            raise ValueError(f"positions: expected the packed row's 3-D rotary positions [3, 1, Tp], got "
                             f"{tuple(positions.shape)}.")
        self.vlm, self.positions = vlm, positions
        self.packed_seq_params, self.output_processor = packed_seq_params, output_processor
        self.rope_calls = 0

    def __enter__(self):
        vlm, lm = self.vlm, self.vlm.language_model
        if "forward" in vars(lm):
            raise ValueError("language_model.forward: already replaced on this instance (a zorro step inside "
                             "another?); run one zorro step at a time.")
        # Megatron-Bridge binds transformers' get_rope_index to the instance in __init__: kept and put back on exit
        self._rope = vars(vlm).get("get_rope_index")
        positions = self.positions

        def get_rope_index(input_ids, *args, **kwargs):
            if tuple(input_ids.shape) != (1, positions.shape[-1]):
                raise ValueError(f"get_rope_index: expected the packed row's ids [1, {positions.shape[-1]}], got "
                                 f"{tuple(input_ids.shape)} (the model was called outside zorro's step).")
            self.rope_calls += 1
            return positions.to(input_ids.device), None

        call = type(lm).forward.__get__(lm)
        extra = {"packed_seq_params": self.packed_seq_params}
        if self.output_processor is not None:
            extra["output_processor"] = self.output_processor

        def forward(*args, **kwargs):
            if kwargs.get("packed_seq_params") is not None:
                raise ValueError("language_model.forward: the vision-language model passed its own "
                                 "packed_seq_params; zorro's call passes none to it.")
            return call(*args, **{**kwargs, **extra})

        vlm.get_rope_index = get_rope_index
        lm.forward = forward
        return self

    def __exit__(self, *exc):
        del self.vlm.language_model.forward
        if self._rope is None:
            del self.vlm.get_rope_index
        else:
            self.vlm.get_rope_index = self._rope
        return False
