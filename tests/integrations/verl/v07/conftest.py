"""Fixtures for the verl 0.7.1 legacy-actor tests: a 1-process gloo group, tiny fp32 Qwen3 actors (stock and zorro,
same weights), verl 0.7.1 actor configs built from verl's own generated trainer config, verl-layout batches.

These tests run in the second environment ``.venv-verl07`` (``scripts/test_verl07.sh``); elsewhere they skip."""

from __future__ import annotations

import copy
import importlib.metadata as md
import os
import tempfile

import pytest
import torch


def _verl_07():
    try:
        v = md.version("verl")
    except md.PackageNotFoundError:
        return None
    return v if v.startswith("0.7") else None


VERL_07 = _verl_07()
if VERL_07 is None:
    collect_ignore_glob = ["test_*.py"]  # verl 0.7 lives in .venv-verl07 only (it pins numpy<2)


@pytest.fixture(scope="session", autouse=True)
def gloo_group():
    """verl's actor reads torch.distributed ranks: one CPU process, gloo."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    fd, path = tempfile.mkstemp(prefix="zorro-verl07-gloo-")
    os.close(fd)
    os.unlink(path)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def base_model():
    """A tiny fp32 Qwen3 (2 layers, GQA, vocab 128), sdpa attention; copy it per actor."""
    from zorro_verl.testing import tiny_model

    return tiny_model("qwen3", dtype=torch.float32, seed=0, exact_norms=False)


def _generated_trainer_config():
    import verl
    from omegaconf import OmegaConf

    path = os.path.join(os.path.dirname(verl.__file__), "trainer", "config", "_generated_ppo_trainer.yaml")
    return OmegaConf.load(path)


def make_actor_node(*, zorro: dict | None = None, use_remove_padding: bool = True, use_dynamic_bsz: bool = False,
                    mini: int = 8, micro: int = 4, max_token_len: int = 64, loss_agg_mode: str = "seq-mean-token-mean",
                    use_kl_loss: bool = True, entropy_coeff: float = 0.01, ppo_epochs: int = 1, **extra):
    """The ``actor_rollout_ref.actor`` node of verl 0.7.1's generated trainer config, per-GPU sizes already
    normalised (as the worker does), fp32 params, no torch.compile; ``zorro`` selects the zorro fsdp_config."""
    from omegaconf import OmegaConf, open_dict

    root = _generated_trainer_config()
    with open_dict(root):
        a = root.actor_rollout_ref.actor
        a.ppo_mini_batch_size = mini
        a.ppo_micro_batch_size_per_gpu = micro
        a.use_dynamic_bsz = use_dynamic_bsz
        a.ppo_max_token_len_per_gpu = max_token_len
        a.loss_agg_mode = loss_agg_mode
        a.use_kl_loss = use_kl_loss
        a.entropy_coeff = entropy_coeff
        a.ppo_epochs = ppo_epochs
        a.use_torch_compile = False
        a.use_remove_padding = use_remove_padding
        a.fsdp_config.dtype = "float32"
        a.fsdp_config.use_torch_compile = False
        for k, v in extra.items():
            OmegaConf.update(a, k, v, force_add=True)
        if zorro is not None:
            a.fsdp_config._target_ = "zorro_verl.integrations.verl.v07.config.ZorroLegacyFSDPEngineConfig"
            a.fsdp_config.zorro = zorro
    return root.actor_rollout_ref.actor


def make_actor_config(**kw):
    """``FSDPActorConfig`` dataclass of :func:`make_actor_node` (what the worker passes to the actor)."""
    from verl.utils.config import omega_conf_to_dataclass

    return omega_conf_to_dataclass(make_actor_node(**kw))


ZORRO_ON = {"enable": True, "rollout_n": 4, "logits_optimization": "none", "attention_backend": "sdpa",
            "on_unsupported": "raise"}


def make_actor(cls, model, config, lr: float = 1.0):
    """An actor with its own copy of ``model`` and an SGD optimizer (deterministic, no state)."""
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    return cls(config=config, actor_module=m, actor_optimizer=opt)


def make_batch(*, batch_size: int = 16, groups: int = 4, prompt_len: int = 12, response_len: int = 8,
               shuffle: bool = True, seed: int = 0, use_dynamic_bsz: bool = False, micro: int = 4,
               max_token_len: int = 64, allow_empty: bool = True):
    """A verl DataProto: ``groups`` prompts x ``batch_size/groups`` responses, padded (unequal prompt and response
    lengths, 1-token and 0-token responses), siblings interleaved when ``shuffle``; training fields included.

    ``allow_empty=False`` gives 0-token responses one token: verl's seq-mean losses divide each micro-batch by its
    count of *non-empty* rows, so only then is the loss independent of which rows share a micro-batch."""
    from zorro_verl.testing import create_dummy_batch

    b = create_dummy_batch(batch_size=batch_size, num_unique_prompts=groups, prompt_len=prompt_len,
                           response_len=response_len, device="cpu", include_training_fields=True, add_padding=True,
                           vocab_size=128, seed=seed, shuffle=shuffle)
    tensors = dict(b)
    if not allow_empty:
        R = response_len
        empty = tensors["attention_mask"][:, -R:].sum(1) == 0
        P = tensors["input_ids"].shape[1] - R
        tensors["attention_mask"][empty, P] = 1
        tensors["response_mask"][empty, 0] = 1
        tensors["input_ids"][empty, P] = 7
        tensors["responses"][empty, 0] = 7
        tensors["position_ids"][empty, P] = tensors["attention_mask"][empty, :P].sum(1)
        for k in ("old_log_probs", "ref_log_prob"):
            tensors[k][empty, 0] = -1.0
    return to_data_proto(tensors, use_dynamic_bsz=use_dynamic_bsz, micro=micro, max_token_len=max_token_len)


def to_data_proto(tensors: dict, *, use_dynamic_bsz: bool = False, micro: int = 4, max_token_len: int = 64):
    """A verl DataProto of a verl-layout tensor dict (training fields included), with the compute_log_prob meta."""
    import numpy as np
    from verl import DataProto

    tensors = dict(tensors)
    tensors["old_log_probs"] = tensors["old_log_probs"].float()
    meta = {"temperature": 0.7, "micro_batch_size": micro, "use_dynamic_bsz": use_dynamic_bsz,
            "max_token_len": max_token_len, "pad_token_id": 0}
    uid = np.array([str(i) for i in range(tensors["input_ids"].shape[0])], dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid}, meta_info=meta)


@pytest.fixture(scope="session", autouse=True)
def cpu_bert_padding():
    """The stock remove-padding path imports flash-attn's ``bert_padding`` (CUDA-only wheel). verl 0.7.1 ships a
    pure-torch copy (``verl.utils.npu_flash_attn_utils``, used on NPUs); route the CPU tests to it."""
    import verl.utils.attention_utils as au
    import verl.utils.npu_flash_attn_utils as pure

    original = au._get_attention_functions
    au._get_attention_functions = lambda: (pure.index_first_axis, pure.pad_input, pure.rearrange, pure.unpad_input)
    yield
    au._get_attention_functions = original


def fsdp2_wrap(model):
    """A copy of ``model`` sharded the way verl 0.7.1's worker does for ``strategy=fsdp2`` (``apply_fsdp2``: each
    decoder layer, then the root; fp32 mixed precision with input casting), on a 1-rank CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from verl.utils.fsdp_utils import apply_fsdp2

    m = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=True)
    # verl 0.7.1 indexes model._no_split_modules, a set in transformers 5: name the layer class explicitly.
    apply_fsdp2(m, {"mesh": mesh, "mp_policy": mp, "offload_policy": None, "reshard_after_forward": True},
                {"wrap_policy": {"transformer_layer_cls_to_wrap": [type(m.model.layers[0]).__name__]}})
    return m
