"""The models verl 0.9.1 runs over rollouts outside its training engines: the reward model and the distillation
teacher (docs/design/verl.md, "Reward model and distillation teacher").

Both run inside an inference server, not in a verl engine zorro subclasses:

* **A model reward model** (``reward.reward_model``, legacy ``reward_model``): ``RewardModelManager`` starts rollout
  replicas with ``is_reward_model=True`` (vLLM / SGLang servers) and ``RewardLoopWorker.compute_score_disrm``
  re-renders each rollout under the reward model's chat template and posts **one request per rollout** (vLLM
  ``/classify``, SGLang ``/v1/embeddings``). verl 0.9.1 has no FSDP / Megatron reward-model worker.
* **The distillation teacher** (``distillation.teacher_models.<key>``): ``TeacherModelManager`` starts rollout
  replicas with ``is_teacher_model=True`` and ``AsyncTeacherLLMServerManager.compute_teacher_logprobs_single``
  sends **one request per rollout** (``prompt_ids + response_ids``, ``max_tokens=1``, ``prompt_logprobs`` = top-k
  or 0) through the teacher's LLM server client.

So there is no forward zorro could deduplicate; the student's side of distillation runs in the actor engine (zorro's
FSDP engine computes verl's top-k distillation outputs and the estimator losses' log-probs). A config that asks for
zorro in either place (a ``zorro`` node, or a ``zorro`` key anywhere under the role's config) would otherwise be
ignored silently by verl; :func:`check_roles` raises instead, from the trainer's constructor (the balancing hooks
wrap it) and in ``zorro-verl doctor``. Reads plain mappings / OmegaConf nodes only (imports no verl).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Optional

__all__ = ["ROLE_REASONS", "config_value", "unsupported_roles", "check_roles", "wrap_trainer_init", "install_v0_hook",
           "install_v1_hook"]

#: Per role the config paths where a user could ask for zorro, and the reason zorro cannot run there.
ROLE_REASONS = {
    "reward model": (("reward.reward_model", "reward_model"),
                     "verl 0.9.1 runs a model reward model inside an inference server (vLLM /classify, SGLang "
                     "embeddings: one request per rollout from its reward loop), not in a verl training engine, so "
                     "zorro has no forward to deduplicate there; remove the zorro key from the reward model's config"),
    "distillation teacher": (("distillation",),
                             "verl 0.9.1 scores the student's rollouts with the teacher inside an inference server "
                             "(prompt_logprobs, one request per rollout), not in a verl training engine, so zorro has "
                             "no forward to deduplicate there; remove the zorro key from the distillation config "
                             "(zorro runs the student's side in the actor engine: "
                             "actor_rollout_ref.actor.fsdp_config.zorro)"),
}


def config_value(node, path: str):
    """The value at dotted ``path`` of a config (None where any part is missing or does not resolve)."""
    for part in path.split("."):
        if node is None or not isinstance(node, Mapping) and not hasattr(node, "get"):
            return None
        try:
            node = node.get(part)
        except Exception:  # noqa: BLE001 - an OmegaConf interpolation that does not resolve: no zorro there
            return None
    return node


def _zorro_keys(node, prefix: str) -> list[str]:
    """Config paths of every ``zorro`` key under ``node`` (mappings only; lists are not searched)."""
    if node is None or not (isinstance(node, Mapping) or hasattr(node, "items")):
        return []
    out = []
    try:
        items = list(node.items())
    except Exception:  # noqa: BLE001 - unresolvable interpolations: skip the node
        return []
    for k, v in items:
        path = f"{prefix}.{k}"
        if k == "zorro":
            out.append(path)
        else:
            out += _zorro_keys(v, path)
    return out


def unsupported_roles(config) -> list[str]:
    """One message per role of ``config`` (a verl trainer config: OmegaConf or nested mappings) that carries a
    ``zorro`` key where zorro cannot run (:data:`ROLE_REASONS`), naming the key and the reason; ``[]`` otherwise."""
    out = []
    for role, (paths, why) in ROLE_REASONS.items():
        keys: list[str] = []
        for path in paths:
            keys += _zorro_keys(config_value(config, path), path)
        if keys:
            out.append(f"zorro for the {role} ({', '.join(keys)}): {why}.")
    return out


def check_roles(config) -> None:
    """``ValueError`` with :func:`unsupported_roles`' messages when ``config`` asks for zorro in the reward model or
    the distillation teacher."""
    msgs: Optional[list[str]] = unsupported_roles(config) if config is not None else None
    if msgs:
        raise ValueError(" ".join(msgs))


def wrap_trainer_init(cls) -> None:
    """Make ``cls.__init__`` (a verl trainer taking ``config`` first) run :func:`check_roles` on its config before
    anything is built (once; subclasses that call ``super().__init__`` are covered too)."""
    orig = cls.__init__
    if getattr(orig, "_zorro_roles", False):
        return

    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        check_roles(kwargs["config"] if "config" in kwargs else args[0] if args else None)
        orig(self, *args, **kwargs)

    __init__._zorro_roles = True
    cls.__init__ = __init__


def install_v0_hook(module) -> None:
    """Post-import hook of ``verl.trainer.ppo.ray_trainer``: the V0 ``RayPPOTrainer`` checks its config's roles."""
    wrap_trainer_init(module.RayPPOTrainer)


def install_v1_hook(module) -> None:
    """Post-import hook of ``verl.trainer.ppo.v1.trainer_base``: the V1 ``PPOTrainer`` checks its config's roles."""
    wrap_trainer_init(module.PPOTrainer)
