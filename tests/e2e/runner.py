"""Launch verl's ``main_ppo`` as a subprocess (time limit, own Ray temp dir, peak memory, cleanup) and read its step
metrics from the console logger. Used by tests/e2e/test_main_ppo.py and scripts/gpu_e2e.sh."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["RunResult", "STRATEGIES", "base_overrides", "critic_overrides", "set_override", "run_main_ppo",
           "parse_step_metrics", "read_rollouts", "expected_dedup", "rel_diff", "format_table", "process_role",
           "fallback_metrics", "schedule",
           "REPO_ROOT", "ENGINE_LINE", "FSDP_ENGINE_LINE", "MEGATRON_ENGINE_LINE"]

REPO_ROOT = Path(__file__).resolve().parents[2]
ENGINE_LINE = re.compile(r"zorro: FSDP engine active on rank (\d+)")
#: the same line's mode: "deduplicated forward" or "stock forward: <reason>" (one line per engine: actor, reference,
#: critic on every worker)
FSDP_ENGINE_LINE = re.compile(r"zorro: FSDP engine active on rank \d+ \((deduplicated forward|stock forward: [^;]*);")
#: the Megatron engine's line (one per engine: actor and reference on every worker); group 1 says whether the
#: engine deduplicates ("deduplicated forward") or runs stock ("stock forward: <reason>")
MEGATRON_ENGINE_LINE = re.compile(r"zorro: Megatron engine active \((deduplicated forward|stock forward: [^;]*);")
# a run that logs one of these never finishes on its own (e.g. a failed weight sync leaves the trainer waiting):
# it is stopped FATAL_GRACE_S seconds later instead of at its time limit
FATAL = re.compile(r"Worker failed with error|EngineDeadError|Error executing job")
FATAL_GRACE_S = 20.0
# lines that name a cause: what RunResult.tail shows of a failed run's log besides its last lines
_CAUSE = re.compile(r"Error|Exception|Killed|[Ss]ignal|Traceback|No such file")
_STEP_LINE = re.compile(r"(?:^|\s)step:(\d+) - (.*)$")


@dataclass
class RunResult:
    name: str
    returncode: int
    seconds: float
    peak_rss_gb: float
    log_path: Path
    rollout_dir: Path
    steps: dict = field(default_factory=dict)  # step -> {metric: float}
    engine_ranks: set = field(default_factory=set)
    fsdp_engines: list = field(default_factory=list)  # FSDP_ENGINE_LINE's group 1, one per engine line
    megatron_engines: list = field(default_factory=list)  # MEGATRON_ENGINE_LINE's group 1, one per engine line
    timed_out: bool = False
    role_peak_gb: dict = field(default_factory=dict)  # process role -> peak RSS of one process of that role (GiB)

    def tail(self, n: int = 60) -> str:
        """The log's last ``n`` lines, after its first lines that name an error (a failed run's last lines are often
        the driver's own traceback; the cause, e.g. a vLLM engine process's, came earlier)."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        first = [ln for ln in lines[:-n] if _CAUSE.search(ln)][:12]
        head = ["[first error lines of the log]", *first, "[last lines]"] if first else []
        return "\n".join(head + lines[-n:])


#: FSDP strategies of verl's FSDP engine: FSDP2, and FSDP1 (``fsdp``, verl's default); ``megatron``: verl's Megatron
#: engine (the ``zorro_megatron_trainer`` preset, ``model_engine=megatron``).
STRATEGIES = ("fsdp2", "fsdp", "megatron")
#: megatron-core settings of the Megatron runs on the CPU (as the Megatron engine tests build verl's engine): no fused
#: CUDA kernels (gradient-accumulation fusion needs a CUDA extension; the fused softmax / bias / RoPE / norm /
#: cross-entropy paths are CUDA or Transformer Engine kernels) and CPU initialisation
MEGATRON_CPU_TRANSFORMER = {"gradient_accumulation_fusion": False, "masked_softmax_fusion": False,
                            "bias_activation_fusion": False, "bias_dropout_fusion": False, "apply_rope_fusion": False,
                            "persist_layer_norm": False, "use_cpu_initialization": True,
                            "cross_entropy_loss_fusion": False}


def base_overrides(assets: dict, *, out_dir: Path, steps: int = 2, n: int = 4, seed: int = 7,
                   dtype: str = "fp32", lr: float = 2e-3, strategy: str = "fsdp2",
                   param_dtype: str | None = None, tp: int = 1) -> list[str]:
    """GRPO on the tiny assets: all prompts in one batch (train_batch_size = number of prompts), ``n`` rollouts
    each, reference model + low-var KL loss, entropy bonus, actor/ref under ``strategy`` (``fsdp2`` or ``fsdp``) in
    ``dtype`` (computing in ``param_dtype``, default ``dtype``: verl's mixed precision), vLLM rollouts with rollout
    log-probs (for verl's rollout-vs-actor metrics), console logger, rollout dump in ``out_dir``.

    ``strategy`` sets ``actor_rollout_ref.actor.strategy`` (which the engine workers look the engine up by; verl's
    config makes ``actor_rollout_ref.ref.strategy`` follow it, and its actor config copies each role's strategy into
    its ``fsdp_config.strategy``, also set here explicitly). FSDP1 needs no other override on CPU: what it needs
    there (module-state broadcast of CPU tensors, the reference model's parameter offload without pinning, verl's
    weight export) is adapted in every process by tests/support/verl_cpu_e2e.py (tests/support/fsdp1_cpu.py).

    ``strategy="megatron"`` (launch with the ``zorro_megatron_trainer`` preset): the actor and reference on verl's
    Megatron engine in ``dtype`` (``fp32`` only: the CPU runs compute in fp32), tensor parallel size ``tp``, verl's
    default model builder (Megatron-Bridge), megatron-core without fused CUDA kernels
    (:data:`MEGATRON_CPU_TRANSFORMER`), without the distributed optimizer (megatron-core's refuses SGD: "Only Adam,
    HybridDeviceOptimizer, and optimizers with an init_state_fn ... are currently supported"); the CPU patches
    come with ``ZORRO_E2E_MEGATRON`` in the environment (tests/support/verl_cpu_e2e.py)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: expected one of {STRATEGIES} (verl's FSDP or Megatron engine), got {strategy!r}.")
    b = assets["num_prompts"]
    mp = f"{{param_dtype:{param_dtype or dtype},reduce_dtype:fp32,buffer_dtype:fp32}}"
    if strategy == "megatron":
        if dtype != "fp32" or param_dtype not in (None, "fp32"):
            raise ValueError(f"dtype: the Megatron CPU runs compute in fp32, got dtype={dtype!r}, "
                             f"param_dtype={param_dtype!r}.")
        meg = "actor_rollout_ref.actor.megatron"
        engine = [f"{meg}.tensor_model_parallel_size={tp}", f"{meg}.dtype=float32",
                  "actor_rollout_ref.ref.megatron.dtype=float32", f"{meg}.seed={seed}",
                  f"{meg}.use_distributed_optimizer=False", f"{meg}.vanilla_mbridge=False",
                  *(f"+{meg}.override_transformer_config.{k}={v}" for k, v in MEGATRON_CPU_TRANSFORMER.items())]
    else:
        engine = [f"actor_rollout_ref.actor.fsdp_config.strategy={strategy}",
                  f"actor_rollout_ref.actor.fsdp_config.model_dtype={dtype}",
                  f"++actor_rollout_ref.actor.fsdp_config.mixed_precision={mp}",
                  f"actor_rollout_ref.actor.fsdp_config.seed={seed}",
                  f"actor_rollout_ref.ref.fsdp_config.strategy={strategy}",
                  f"actor_rollout_ref.ref.fsdp_config.model_dtype={dtype}",
                  f"++actor_rollout_ref.ref.fsdp_config.mixed_precision={mp}"]
    return [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={assets['train']}",
        f"data.val_files={assets['train']}",
        f"data.train_batch_size={b}",
        "data.max_prompt_length=64",
        "data.max_response_length=16",
        "data.filter_overlong_prompts=False",
        "data.truncation=error",
        "data.dataloader_num_workers=0",
        f"data.seed={seed}",
        f"actor_rollout_ref.model.path={assets['model']}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        f"actor_rollout_ref.actor.optim.lr={lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={b}",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.1",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.actor.calculate_entropy=True",
        f"actor_rollout_ref.actor.data_loader_seed={seed}",
        f"actor_rollout_ref.actor.strategy={strategy}",
        *engine,
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.n={n}",
        f"actor_rollout_ref.rollout.seed={seed}",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.max_model_len=128",
        "actor_rollout_ref.rollout.max_num_seqs=32",
        "actor_rollout_ref.rollout.max_num_batched_tokens=2048",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "reward.num_workers=1",
        f"reward.custom_reward_function.path={assets['reward']}",
        "reward.custom_reward_function.name=compute_score",
        f"trainer.total_training_steps={steps}",
        "trainer.total_epochs=100",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[console]",
        "trainer.project_name=zorro_e2e",
        f"trainer.experiment_name={out_dir.name}",
        f"trainer.default_local_dir={out_dir / 'ckpt'}",
        f"trainer.rollout_data_dir={out_dir / 'rollouts'}",
    ]


def critic_overrides(assets: dict, *, seed: int = 7, dtype: str = "fp32", param_dtype: str | None = None,
                     strategy: str = "fsdp2", optimizer: str = "SGD", lr: float = 0.1, mini: int | None = None,
                     max_tokens: int = 512, gradient_checkpointing: bool = False) -> list[str]:
    """PPO with a critic on the assets: ``algorithm.adv_estimator=gae`` (which makes verl build its critic), the
    value model from the actor's checkpoint (verl loads it as ``AutoModelForTokenClassification``, a fresh
    ``Linear(H, 1)`` score head) under ``strategy`` in ``dtype`` (computing in ``param_dtype``), sdpa attention (the
    e2e plugin makes verl's value-model loader use the config's attention instead of the flash-attention it
    hard-codes), ``optimizer`` at ``lr`` without weight decay, ``mini`` prompts per critic mini-batch (default: the
    actor's), ``max_tokens`` per micro-batch (dynamic batch size, when the actor's is on: the critic follows it). The
    critic's zorro switch follows the actor's in the preset (``critic.fsdp.zorro.enable``)."""
    mp = f"{{param_dtype:{param_dtype or dtype},reduce_dtype:fp32,buffer_dtype:fp32}}"
    return [
        "algorithm.adv_estimator=gae",
        f"critic.model.path={assets['model']}",
        f"critic.model.enable_gradient_checkpointing={gradient_checkpointing}",
        "+critic.model.override_config.attn_implementation=sdpa",
        f"critic.strategy={strategy}",
        f"critic.fsdp.strategy={strategy}",
        f"critic.fsdp.model_dtype={dtype}",
        f"++critic.fsdp.mixed_precision={mp}",
        f"critic.fsdp.seed={seed}",
        f"critic.optim.optimizer={optimizer}",
        f"critic.optim.lr={lr}",
        "critic.optim.weight_decay=0.0",
        f"critic.data_loader_seed={seed}",
        f"critic.ppo_max_token_len_per_gpu={max_tokens}",
        *([f"critic.ppo_mini_batch_size={mini}"] if mini is not None else []),
    ]


def set_override(overrides: list[str], key: str, value) -> None:
    """Set Hydra override ``key=value`` in ``overrides`` in place, replacing an earlier one of the same key (Hydra
    refuses a key given twice; a ``+``/``++`` prefix of the earlier one is kept)."""
    bare = [o.lstrip("+").split("=", 1)[0] for o in overrides]
    if key.lstrip("+") in bare:
        i = bare.index(key.lstrip("+"))
        prefix = overrides[i][: len(overrides[i]) - len(overrides[i].lstrip("+"))]
        overrides[i] = f"{prefix}{key.lstrip('+')}={value}"
    else:
        overrides.append(f"{key}={value}")  # a new key keeps the "+" the caller gave it


def micro_batch_overrides(*, dynamic: bool, micro: int = 4, max_tokens: int = 512) -> list[str]:
    a = "actor_rollout_ref"
    if dynamic:
        return [f"{a}.actor.use_dynamic_bsz=True", f"{a}.actor.ppo_max_token_len_per_gpu={max_tokens}",
                f"{a}.ref.log_prob_use_dynamic_bsz=True", f"{a}.ref.log_prob_max_token_len_per_gpu={max_tokens}",
                f"{a}.rollout.log_prob_use_dynamic_bsz=True",
                f"{a}.rollout.log_prob_max_token_len_per_gpu={max_tokens}"]
    return [f"{a}.actor.use_dynamic_bsz=False", f"{a}.actor.ppo_micro_batch_size_per_gpu={micro}",
            f"{a}.ref.log_prob_micro_batch_size_per_gpu={micro}",
            f"{a}.rollout.log_prob_micro_batch_size_per_gpu={micro}"]


_WRAPPED = re.compile(r"^[A-Za-z_][\w.]*\((.*)\)$")  # np.float64(0.5), tensor(0.5) (the V0 trainer logs numpy scalars)


def _num(v: str):
    v = v.strip()
    m = _WRAPPED.match(v)
    if m:
        v = m.group(1).split(",")[0].strip()
    try:
        return float(v)
    except ValueError:
        pass
    try:
        x = ast.literal_eval(v)
        return float(x) if isinstance(x, (int, float)) else None
    except (ValueError, SyntaxError):
        return None


def parse_step_metrics(text: str) -> dict:
    """``{step: {metric: value}}`` from verl's console logger lines (``step:N - key:value - ...``)."""
    steps: dict[int, dict] = {}
    for line in text.splitlines():
        m = _STEP_LINE.search(line)
        if not m:
            continue
        vals = {}
        for part in m.group(2).split(" - "):
            if ":" not in part:
                continue
            k, v = part.rsplit(":", 1)
            x = _num(v)
            if x is not None:
                vals[k.strip()] = x
        if vals:
            steps.setdefault(int(m.group(1)), {}).update(vals)
    return steps


def read_rollouts(rollout_dir: Path, step: int) -> list[dict]:
    """verl's rollout dump of ``step`` (JSONL: input, output, gts, score, uid), sorted by (input, output)."""
    f = Path(rollout_dir) / f"{step}.jsonl"
    rows = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    return sorted(rows, key=lambda r: (r.get("input", ""), r.get("output", ""), r.get("score", 0)))


def expected_dedup(metrics: dict, n: int) -> float:
    """dedup ratio ordinary tokens / deduplicated tokens of a batch whose prompts each have ``n`` rollouts and whose
    groups stay whole in a micro-batch: ``(P + R) / (P / n + R)`` with ``P``, ``R`` the batch's mean prompt and
    response lengths (verl's ``prompt_length/mean``, ``response_length/mean``)."""
    p, r = metrics["prompt_length/mean"], metrics["response_length/mean"]
    return (p + r) / (p / n + r)


def fallback_metrics(metrics: dict) -> dict:
    """The step metrics that count zorro falling back to stock: the engine's ``.../zorro/fallback_batches`` and the
    balance hook's ``.../balance_fallbacks`` (``{key: value}``; a zorro run logs both, each 0 when nothing fell
    back)."""
    return {k: v for k, v in metrics.items() if k.endswith(("zorro/fallback_batches", "balance_fallbacks"))}


def rel_diff(a: float, b: float, floor: float = 1e-6) -> float:
    """|a - b| / max(|a|, |b|, floor): relative, with an absolute floor for values that are ~0 by construction
    (step-1 KL of an actor equal to its reference)."""
    return abs(a - b) / max(abs(a), abs(b), floor)


#: Ray's process titles (``ray::<actor class>.<method>``) and vLLM's -> the role reported in ``role_peak_gb``.
_ROLES = (("WorkerDict", "train worker"), ("ActorRolloutRef", "train worker"), ("vLLMHttpServer", "rollout server"),
          ("EngineCore", "vLLM engine"), ("TaskRunner", "trainer"), ("AgentLoopWorker", "agent loop"),
          ("RewardLoopWorker", "reward"), ("raylet", "ray"), ("gcs_server", "ray"), ("dashboard", "ray"))


def process_role(cmdline: str) -> str:
    """The role of one process of a run from its command line (Ray sets ``ray::<class>.<method>`` titles):
    ``train worker`` (actor/ref FSDP workers), ``rollout server``, ``vLLM engine``, ``trainer``, ``agent loop``,
    ``reward``, ``ray`` (Ray's own daemons), ``driver`` (``main_ppo`` itself) or ``other``."""
    for needle, role in _ROLES:
        if needle in cmdline:
            return role
    if "verl.trainer.main_ppo" in cmdline:
        return "driver"
    return "other"


def _tree_rss(proc, roles: dict | None = None) -> int:
    """Resident bytes of ``proc`` and its descendants; with ``roles``, also the largest single process of each role
    (``{role: bytes}``, updated to the running maximum)."""
    import psutil

    total = 0
    try:
        procs = [proc] + proc.children(recursive=True)
    except psutil.Error:
        return 0
    for p in procs:
        try:
            rss = p.memory_info().rss
            total += rss
            if roles is not None:
                role = process_role(" ".join(p.cmdline()))
                roles[role] = max(roles.get(role, 0), rss)
        except psutil.Error:
            pass
    return total


def _shm_entries() -> set:
    try:
        return {e for e in os.listdir("/dev/shm") if e.startswith(("psm_", "verl_weights_"))}
    except OSError:
        return set()


def _shm_in_use() -> set:
    """Names of the ``/dev/shm`` entries that a live process (any, not only this run's) has mapped or open. Two runs
    side by side share ``/dev/shm``: a segment that appeared during one run may be the other's (vLLM's, or verl's
    weight bucket, which its receiver opens by name later), and unlinking it would break that run."""
    used = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps", errors="replace") as f:
                for line in f:
                    i = line.find("/dev/shm/")
                    if i >= 0:
                        used.add(line[i + 9:].split()[0])
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    used.add(target[9:].split()[0])
        except OSError:  # the process ended, or is not ours to read
            continue
    return used


def run_main_ppo(name: str, overrides: list[str], *, work: Path, env: dict, python: str = sys.executable,
                 config_path: Path | None = None, config_name: str = "zorro_ppo_trainer",
                 timeout_s: int = 420) -> RunResult:
    """Run ``python -m verl.trainer.main_ppo`` with ``overrides`` (time limit ``timeout_s``), in its own process
    group and Ray temp dir; afterwards kill what is left of the group, remove the Ray temp dir and the vLLM
    ``/dev/shm/psm_*`` segments that appeared during the run and no live process holds (a run beside may). Log in
    ``work/<name>.log``."""
    import psutil

    config_path = config_path or (REPO_ROOT / "configs")
    out_dir = Path(work) / name
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = Path(work) / f"{name}.log"
    ray_tmp = Path(tempfile.mkdtemp(prefix="zr", dir="/tmp"))  # short: Ray's socket paths are length-limited
    cmd = [python, "-m", "verl.trainer.main_ppo", f"--config-path={config_path}", f"--config-name={config_name}",
           *overrides, f"+ray_kwargs.ray_init._temp_dir={ray_tmp}"]
    full_env = {**os.environ, **env, "RAY_TMPDIR": str(ray_tmp)}
    shm_before = _shm_entries()
    peak = 0
    roles: dict[str, int] = {}
    t0 = time.time()
    timed_out = False
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=str(out_dir),
                                start_new_session=True)
        ps = psutil.Process(proc.pid)
        stop = threading.Event()

        fatal_at = None

        def sample():
            nonlocal peak, fatal_at
            pos = 0
            while not stop.is_set():
                peak = max(peak, _tree_rss(ps, roles))
                with open(log_path, errors="replace") as f:
                    f.seek(pos)
                    chunk = f.read()
                    pos = f.tell()
                if fatal_at is None and FATAL.search(chunk):
                    fatal_at = time.time()
                if fatal_at is not None and time.time() - fatal_at > FATAL_GRACE_S:
                    _kill_group(proc.pid)
                    return
                stop.wait(0.5)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            rc = 124
        finally:
            stop.set()
            th.join()
            _kill_group(proc.pid)
            if proc.poll() is None:
                proc.wait(timeout=30)
    seconds = time.time() - t0
    shutil.rmtree(ray_tmp, ignore_errors=True)
    # this run's processes are gone (its group was killed): what it left is no live process's; what another run
    # side by side made is still mapped by that run, and stays
    for e in _shm_entries() - shm_before - _shm_in_use():
        try:
            os.unlink(os.path.join("/dev/shm", e))
        except OSError:
            pass
    text = log_path.read_text(errors="replace")
    return RunResult(name=name, returncode=rc, seconds=seconds, peak_rss_gb=peak / 2**30, log_path=log_path,
                     rollout_dir=out_dir / "rollouts", steps=parse_step_metrics(text),
                     engine_ranks={int(m) for m in ENGINE_LINE.findall(text)},
                     fsdp_engines=FSDP_ENGINE_LINE.findall(text),
                     megatron_engines=MEGATRON_ENGINE_LINE.findall(text), timed_out=timed_out,
                     role_peak_gb={k: v / 2**30 for k, v in roles.items()})


def _kill_group(pgid: int) -> None:
    """SIGTERM, then SIGKILL, the run's process group (Ray's gcs/raylet/workers started by the driver)."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.time() + wait
        while time.time() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def format_table(rows: list[tuple], header: tuple) -> str:
    cells = [tuple(str(c) for c in header)] + [tuple(str(c) for c in r) for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)) for r in cells]
    lines.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(lines)


def recordings_first(names: list, recorder) -> list:
    """``names`` with the runs that another of them replays (``recorder(name)``) first, each group in list order:
    started in that order, the recordings are over by the time the replays run, so the last runs to go are replays
    that wait for nothing, side by side (not one replay alone after its late recording)."""
    recs = {recorder(n) for n in names} - {None}
    return [n for n in names if n in recs] + [n for n in names if n not in recs]


def schedule(names: list, parallel, start, recorder, poll_s: float = 2.0) -> None:
    """Runs ``start(name)`` for every name, at most ``parallel`` at a time (threads; an int, or a callable giving the
    current width, read again every ``poll_s`` seconds), in list order except that a run starts only after
    ``recorder(name)`` (the run recording the rollouts it replays, or None) has finished, when that one is among
    ``names``. ``start`` returns when its run is over; an exception in it is raised here."""
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    width = parallel if callable(parallel) else (lambda: parallel)
    pending, done, running = list(names), set(), {}
    with ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:
        while pending or running:
            for name in list(pending):
                if len(running) >= max(1, width()):
                    break
                dep = recorder(name)
                if dep is None or dep in done or dep not in names:
                    pending.remove(name)
                    running[pool.submit(start, name)] = name
            if not running:  # a cycle or a missing recorder: never expected with RUNS
                raise RuntimeError(f"e2e runs {pending}: their recording runs never finish")
            finished, _ = wait(running, timeout=poll_s, return_when=FIRST_COMPLETED)
            for f in finished:
                done.add(running.pop(f))
                f.result()  # an exception in start (not a failed run: that is a result) stops the session
