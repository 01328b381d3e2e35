"""Run-time setup for verl's whole ``main_ppo`` loop on a CPU-only host with the CPU build of vLLM (tests/e2e only;
it never ships with the package).

Every process of such a run (the ``main_ppo`` driver, Ray's trainer, worker, TransferQueue, agent-loop, reward and
vLLM-server actors) imports :mod:`tests.support.verl_cpu_e2e_plugin` at ``import verl``, because :func:`e2e_env`
names it in ``VERL_USE_EXTERNAL_MODULES``; that import calls :func:`install`, which:

* registers verl platform ``cpu`` (the device module of :mod:`tests.support.verl_cpu_platform`) with Ray resource
  name ``"GPU"``: verl places its workers and the rollout server on Ray's ``GPU`` resource (Ray refuses a request
  for ``"CPU"`` by that route), so the run starts Ray with *logical* GPUs (``+ray_kwargs.ray_init.num_gpus=N``);
  IPC is reported unsupported, so verl syncs weights to vLLM through its shared-memory bucket path;
* makes a process group requested as ``cpu:gloo,cpu:gloo`` (verl's ``"cpu:gloo,<device>:<backend>"`` with device
  ``cpu``) plain ``gloo`` (torch refuses a device type listed twice);
* makes FSDP1 (``strategy: fsdp``) accept CPU parameters: verl always passes ``sync_module_states=True``, which
  torch refuses for them; every rank loads the same checkpoint, so :func:`tests.support.fsdp1_cpu.allow_cpu_fsdp1`
  turns it off;
* turns off ``pin_memory`` in FSDP2's ``CPUOffloadPolicy`` (verl builds the reference model with
  ``CPUOffloadPolicy(pin_memory=True)``; pinning needs an accelerator);
* lets the vLLM side of the shared-memory weight sync release its segment although tensors may still view it: on
  CPU, ``tensor.to("cpu")`` returns the view itself, so a view can outlive the bucket and ``SharedMemory.close()``
  raises ``BufferError`` ("cannot close exported pointers exist"); after a garbage collection the mapping is left
  to the process's exit instead (the sender unlinks the segment);
* registers ``attn_implementation="cpu_varlen"`` (:mod:`tests.support.cpu_stock_kernels`: per-row causal
  attention of a remove-padding forward, what flash-attn's varlen kernel computes on a GPU) and, with
  ``ZORRO_E2E_STOCK_KERNELS=1``, makes verl's stock engine compute log-probs block-wise (what flash-attn's
  cross-entropy kernel does on a GPU) instead of in a Python loop over tokens: the e2e benchmark's stock runs use
  both, so that stock is not charged for CPU artefacts;
* lets vLLM's idle worker wait on its socket at once instead of busy-looping for a second after each read (on a
  two-core host that second takes a core from the trainer's next phase);
* makes verl's value-model loader (the critic's) use the config's attention instead of the ``flash_attention_2`` it
  hard-codes (:func:`tests.support.verl_engines.use_cpu_value_model_loader`);
* keeps vLLM's CPU linear layers on ``torch.nn.functional.linear`` over their own weights: vLLM's CPU GEMM dispatch
  (oneDNN) repacks each weight after loading and replaces the layer's parameter by an empty one without a
  ``weight_loader``, so the trainer's weight sync into the running server fails with ``AttributeError``.
* with ``ZORRO_E2E_MEGATRON`` set (the runs on verl's Megatron engine, ``model_engine=megatron``): right before a
  process first imports ``verl.workers.engine.megatron`` (the training workers; verl's engine package imports it),
  the Megatron engine tests' CPU patches (:func:`tests.support.megatron_engines.setup_process` without its own
  platform: megatron-core shims P1-P6/P9, mbridge V4-V6, Megatron-Bridge's import stand-ins and local layer spec);
  an fp32 ``McoreEngineConfig`` passes verl's bf16/fp16 assertion (V2; the actor and reference compute in fp32); and
  an engine on verl's padded path (``use_remove_padding=False``, bshd: the stock runs, whose THD path needs
  Transformer Engine's attention) hands megatron's ``DotProductAttention`` the 4-D causal mask built from verl's
  ``[B, S]`` valid mask (V8), a forward pre-hook on each model chunk; verl's ``load_megatron_model_to_gpu`` (run
  before every weight export to vLLM) skips DDP buffers without ``param_data``: megatron-core allocates that only
  for the distributed optimizer, which refuses SGD, and verl reads ``buffer.param_data.storage()`` unguarded.

:func:`install_seeded_rollout` (also installed by :func:`install`; on its own for GPU runs through
:mod:`tests.support.verl_seeded_rollout_plugin`) makes rollouts reproducible across runs: each vLLM request gets a
seed derived from its prompt tokens and how many requests with that prompt the server has seen (vLLM's shared
sampler RNG otherwise depends on how requests happen to be batched). Siblings of a group get different seeds, and
two runs with the same weights produce the same set of responses per prompt.
:func:`install_ordered_batches` goes further: sequential prompt uids (both trainers), each V1 sampled batch in key
order instead of rollout completion order (so verl's balancing, and hence its mini-batches, are the same in two runs
on the same rollouts), and every request seeded on the agent-loop side by its sample's ``{uid}_{session}`` and turn,
whichever rollout server (one per training worker) it lands on. From the second step on two runs' weights differ
by float rounding, which can flip a sampled token, so the first run can record its responses under those keys and
the second replay them (``ZORRO_E2E_ROLLOUT_MODE=record|replay|replay_generate``, ``ZORRO_E2E_ROLLOUT_FILE``):
identical rollouts at every step (``replay`` skips vLLM's generation, ``replay_generate`` runs it and discards it).

The rest of the CPU setup is configuration, see :func:`cpu_overrides`. Refused when CUDA is available.
"""

from __future__ import annotations

import contextvars
import os
from pathlib import Path

import torch

__all__ = ["install", "install_seeded_rollout", "e2e_env", "cpu_overrides", "REPO_ROOT", "ROLLOUT_MODE_ENV",
           "ROLLOUT_FILE_ENV", "POLL_INTERVAL_ENV",
           "STOCK_KERNELS_ENV", "MEGATRON_ENV"]

REPO_ROOT = Path(__file__).resolve().parents[2]
_installed = False


def _platform_class():
    from tests.support.verl_cpu_platform import _platform_class as base_class

    base = base_class()

    class PlatformCPUE2E(base):
        """The CPU test platform, placed on Ray's logical ``GPU`` resource."""

        def ray_resource_name(self) -> str:
            return "GPU"

    return PlatformCPUE2E


def _patch_process_group() -> None:
    import torch.distributed as dist

    if getattr(dist.init_process_group, "_zorro_e2e", False):
        return
    orig = dist.init_process_group

    def init_process_group(*args, **kwargs):
        backend = kwargs.get("backend")
        if isinstance(backend, str) and backend.replace(" ", "") == "cpu:gloo,cpu:gloo":
            kwargs["backend"] = "gloo"
        init_method = kwargs.get("init_method")
        if (kwargs.get("world_size") == 1 and kwargs.get("rank", 0) == 0 and "store" not in kwargs
                and isinstance(init_method, str) and init_method.startswith("tcp://")):
            # a one-process group (vLLM's TP=1 worker) needs no TCP rendezvous: vLLM picks its port by
            # bind-then-close, and another process on a busy host took it between the two (EADDRINUSE killed a
            # run); an in-process store has no port to lose
            del kwargs["init_method"]
            kwargs["store"] = dist.HashStore()
        return orig(*args, **kwargs)

    init_process_group._zorro_e2e = True
    dist.init_process_group = init_process_group


def _patch_offload_policy() -> None:
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy
    except ImportError:  # old torch: verl does not use FSDP2 there
        return
    if getattr(CPUOffloadPolicy.__init__, "_zorro_e2e", False):
        return
    orig = CPUOffloadPolicy.__init__

    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        self.pin_memory = False  # pinned host memory needs an accelerator

    __init__._zorro_e2e = True
    CPUOffloadPolicy.__init__ = __init__


class _PostImportHook:
    """Runs each of ``fns`` (``fn(module)``, in order) right after the module ``name`` is first imported (a
    ``sys.meta_path`` finder)."""

    def __init__(self, name: str, fn):
        self.name, self.fns = name, [fn]

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        import importlib.util
        import sys

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader, fns = spec.loader, self.fns
        orig_exec = loader.exec_module

        def exec_module(module):
            orig_exec(module)
            for fn in fns:
                fn(module)

        loader.exec_module = exec_module
        return spec


class _PreImportHook:
    """Runs ``fn()`` once, right before the module ``name`` is first imported (a ``sys.meta_path`` finder that finds
    nothing itself: the ordinary finders then import the module). ``fn`` must not import ``name``."""

    def __init__(self, name: str, fn):
        self.name, self.fn = name, fn

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name:
            import sys

            sys.meta_path.remove(self)
            self.fn()
        return None


def _before_import(name: str, fn) -> None:
    """``fn()`` now if ``name`` is imported, else right before its first import."""
    import sys

    if name in sys.modules:
        fn()
    else:
        sys.meta_path.insert(0, _PreImportHook(name, fn))


def _after_import(name: str, fn) -> None:
    """``fn(module)`` now if ``name`` is imported, else right after its import (after the hooks registered before;
    the same ``fn`` once)."""
    import sys

    if name in sys.modules:
        fn(sys.modules[name])
        return
    hook = next((f for f in sys.meta_path if isinstance(f, _PostImportHook) and f.name == name), None)
    if hook is None:
        sys.meta_path.insert(0, _PostImportHook(name, fn))
    elif fn not in hook.fns:
        hook.fns.append(fn)


def _patch_weight_receiver(module) -> None:
    orig = getattr(module, "rebuild_shared_memory", None)
    if orig is None or getattr(orig, "_zorro_e2e", False):
        return
    from multiprocessing import shared_memory

    class _SharedMemory(shared_memory.SharedMemory):
        def close(self):
            try:
                super().close()
            except BufferError:
                import gc

                gc.collect()
                try:
                    super().close()
                except BufferError:
                    pass  # a view is still alive: the mapping goes with the process (the sender unlinks it)

    def rebuild_shared_memory(*args, **kwargs):
        tensor, shm = orig(*args, **kwargs)
        shm.__class__ = _SharedMemory
        return tensor, shm

    rebuild_shared_memory._zorro_e2e = True
    module.rebuild_shared_memory = rebuild_shared_memory


def _patch_vllm_cpu_gemm(module) -> None:
    orig = getattr(module, "dispatch_cpu_unquantized_gemm", None)
    if orig is None or getattr(orig, "_zorro_e2e", False):
        return

    def dispatch_cpu_unquantized_gemm(layer, remove_weight: bool) -> None:
        if getattr(layer.weight, "ndim", 2) != 2 or layer.weight.is_meta:
            return orig(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear  # keep the weight (and its weight_loader) for weight syncs

    dispatch_cpu_unquantized_gemm._zorro_e2e = True
    module.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm


def _patch_vllm_idle_spin(module) -> None:
    """vLLM's shared-memory message queue keeps a reader busy-looping (``sched_yield``) for ``busy_loop_s`` = 1 s after
    its last read before it waits on its socket: after each generation the idle vLLM worker keeps a core busy for a
    second, on a two-core host half the machine, while the trainer runs its next phase. Readers here go idle at once
    (the writer notifies them on every write, so nothing is missed)."""
    cls = getattr(module, "SpinCondition", None)
    if cls is None or getattr(cls.__init__, "_zorro_e2e", False):
        return
    orig = cls.__init__

    def __init__(self, *args, **kwargs):
        kwargs["busy_loop_s"] = 0.0
        orig(self, *args, **kwargs)

    __init__._zorro_e2e = True
    cls.__init__ = __init__


def _patch_vllm_server(module) -> None:
    cls = getattr(module, "vLLMHttpServer", None)
    if cls is None or getattr(cls.generate, "_zorro_e2e", False):
        return
    import functools
    import zlib

    orig = cls.generate

    @functools.wraps(orig)
    async def generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs):
        # a seed from the prompt and how often this server has seen it, unless the agent-loop side (which knows the
        # sample's uid and session, _patch_llm_client) already set one
        ids = [int(t) for t in prompt_ids]
        crc = zlib.crc32(",".join(map(str, ids)).encode())
        seen = self.__dict__.setdefault("_zorro_seen", {})
        k = seen.get(crc, 0)
        seen[crc] = k + 1
        sampling_params = dict(sampling_params)
        sampling_params.setdefault("seed", (int(self.config.seed) * 1_000_003 + crc + 7919 * k) % (2**31 - 1))
        return await orig(self, prompt_ids, sampling_params, request_id, *args, **kwargs)

    generate._zorro_e2e = True
    cls.generate = generate


#: (uid, session) of the agent-loop session running in this asyncio task (set around ``_run_agent_loop``).
_SESSION: contextvars.ContextVar = contextvars.ContextVar("zorro_e2e_session", default=None)


def _patch_agent_loop(module) -> None:
    """Remember each agent-loop session's ``(uid, session_id)`` for the requests it sends (a context variable)."""
    import functools

    cls = getattr(module, "AgentLoopWorker", None)
    if cls is None or getattr(cls._run_agent_loop, "_zorro_e2e", False):
        return
    orig = cls._run_agent_loop

    @functools.wraps(orig)
    async def _run_agent_loop(self, *args, **kwargs):
        token = _SESSION.set((str(kwargs.get("uid")), kwargs.get("session_id")))
        try:
            return await orig(self, *args, **kwargs)
        finally:
            _SESSION.reset(token)

    _run_agent_loop._zorro_e2e = True
    cls._run_agent_loop = _run_agent_loop


def _patch_llm_client(module) -> None:
    """Per-request seeds and record/replay on the agent-loop side, keyed by the sample's ``{uid}_{session}`` (uids are
    sequential, :func:`_patch_uids`) and the request's turn in that session: the same in every run, whichever
    rollout server (one per training worker) a request lands on."""
    import functools
    import zlib

    cls = getattr(module, "LLMServerClient", None)
    if cls is None or getattr(cls.generate, "_zorro_e2e", False):
        return
    orig = cls.generate
    turns: dict = {}

    @functools.wraps(orig)
    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        session = _SESSION.get()
        if session is None or session[0] == "None":
            return await orig(self, request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)
        turn = turns.get(session, 0)
        turns[session] = turn + 1
        key = f"{session[0]}_{session[1]}:{turn}"
        sampling_params = dict(sampling_params)
        sampling_params.setdefault("seed", zlib.crc32(key.encode()) % (2**31 - 1))
        if os.environ.get(ROLLOUT_MODE_ENV, "") == "replay" and os.environ.get(ROLLOUT_FILE_ENV, ""):
            # the recorded response without asking vLLM: it would be thrown away (the server still starts and gets
            # every weight update, as in the recording run)
            from verl.workers.rollout.replica import TokenOutput

            rec = _recorded(key)
            # extra_fields: the server's own (its weights version, global_steps, which verl's V1 trainer reads), as
            # the recording run's server returned them at the same step
            return TokenOutput(token_ids=rec["token_ids"], log_probs=rec["log_probs"], stop_reason=rec["stop_reason"],
                               extra_fields=dict(rec["extra_fields"]))
        out = await orig(self, request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)
        return _record_or_replay(key, out, prompt_ids)

    generate._zorro_e2e = True
    cls.generate = generate


#: ``record`` / ``replay`` / ``replay_generate`` (with :data:`ROLLOUT_FILE_ENV`): the vLLM server writes every
#: response it returns; or the recorded response of the same request key is returned without a generation (the e2e
#: tests); or vLLM generates and its response is replaced by the recorded one (the e2e benchmark: its step time
#: counts vLLM's generation alike in every run).
ROLLOUT_MODE_ENV = "ZORRO_E2E_ROLLOUT_MODE"
ROLLOUT_FILE_ENV = "ZORRO_E2E_ROLLOUT_FILE"
_replay: dict = {}


def _record_or_replay(key: str, out, prompt_ids=()):
    """Record mode appends ``out``'s tokens, log-probs and stop reason under ``key`` (one JSON line, with the
    request's ``prompt_ids``: the e2e benchmark's FLOP model reads every row's tokens from it); replay mode
    returns the recorded response for ``key`` in place of ``out``, so that a second run trains on exactly the first
    run's rollouts at every step, although its weights differ from the first run's by float rounding (which can
    flip a sampled token). A key missing from the recording raises: a replay never silently samples anew."""
    import json

    mode, path = os.environ.get(ROLLOUT_MODE_ENV, ""), os.environ.get(ROLLOUT_FILE_ENV, "")
    if not mode or not path or not getattr(out, "token_ids", None):
        return out
    if mode == "record":
        with open(path, "a") as f:
            f.write(json.dumps({"key": key, "prompt_ids": [int(t) for t in prompt_ids],
                                "token_ids": list(out.token_ids), "log_probs": out.log_probs,
                                "stop_reason": out.stop_reason,
                                "extra_fields": {k: v for k, v in (out.extra_fields or {}).items()
                                                 if v is None or isinstance(v, (bool, int, float, str))}}) + "\n")
        return out
    if mode not in ("replay", "replay_generate"):
        raise ValueError(f"{ROLLOUT_MODE_ENV}: expected record, replay or replay_generate, got {mode!r}.")
    rec = _recorded(key)
    return out.model_copy(update={"token_ids": rec["token_ids"], "log_probs": rec["log_probs"],
                                  "stop_reason": rec["stop_reason"]})


def _recorded(key: str) -> dict:
    """The recorded response of request ``key`` (:data:`ROLLOUT_FILE_ENV`, read once per process); a key missing
    from the recording raises."""
    import json

    path = os.environ.get(ROLLOUT_FILE_ENV, "")
    if not _replay:
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                _replay[rec["key"]] = rec
    if key not in _replay:
        raise RuntimeError(f"rollout replay: no recorded response for request {key} in {path}")
    return _replay[key]


def _patch_uids(module) -> None:
    """Sequential prompt uids in a trainer (both draw ``uuid4()`` per prompt): the same uids, in dataset order, in
    every run."""
    import itertools
    import types
    import uuid

    if getattr(module.uuid, "_zorro_e2e", False):
        return
    counter = itertools.count(1)
    module.uuid = types.SimpleNamespace(uuid4=lambda: uuid.UUID(int=next(counter)), UUID=uuid.UUID, _zorro_e2e=True)


def _patch_value_model_loader(module) -> None:
    """verl's ``load_valuehead_model`` (the critic's value model) hard-codes ``flash_attention_2``; on CPU it loads
    with the attention of the model config (``critic.model.override_config.attn_implementation``), as the critic
    engine tests load it (:func:`tests.support.verl_engines.use_cpu_value_model_loader`)."""
    from tests.support.verl_engines import use_cpu_value_model_loader

    use_cpu_value_model_loader()


#: set (to anything) in runs on verl's Megatron engine: the Megatron CPU patches in every process that imports it
MEGATRON_ENV = "ZORRO_E2E_MEGATRON"


def _megatron_setup() -> None:
    """The Megatron engine tests' CPU patches (P1-P6, P9, V4-V6, the bridge's S1/S2/S2a/B1/L1), this module's
    platform kept."""
    from tests.support import megatron_engines

    megatron_engines.setup_process(cpu_platform=False)


def _patch_mcore_fp32(module) -> None:
    """V2: verl's ``McoreEngineConfig`` asserts ``dtype`` bf16 / fp16; an fp32 config (the actor and reference
    compute in fp32 here, as the FSDP runs do) passes the check and keeps ``float32``."""
    cls = getattr(module, "McoreEngineConfig", None)
    if cls is None or getattr(cls.__post_init__, "_zorro_e2e", False):
        return
    orig = cls.__post_init__

    def __post_init__(self):
        if self.dtype not in ("float32", "fp32"):
            return orig(self)
        dtype = self.dtype
        object.__setattr__(self, "dtype", "bfloat16")
        try:
            orig(self)
        finally:
            object.__setattr__(self, "dtype", dtype)

    __post_init__._zorro_e2e = True
    cls.__post_init__ = __post_init__


def _patch_megatron_bshd_mask(module) -> None:
    """V8: an engine on verl's padded path (``use_remove_padding=False``) passes megatron's model a ``[B, S]`` valid
    mask (Transformer Engine's convention); megatron's own ``DotProductAttention`` wants the ``[B, 1, S, S]`` causal
    mask, which :func:`tests.support.megatron_engines._mask_hook` builds with verl's helper."""
    cls = getattr(module, "MegatronEngine", None)
    if cls is None or getattr(cls.initialize, "_zorro_e2e", False):
        return
    orig = cls.initialize

    def initialize(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        if not self.engine_config.use_remove_padding:
            from verl.utils.megatron_utils import unwrap_model

            from tests.support.megatron_engines import _mask_hook

            for chunk in self.module:
                unwrap_model(chunk).register_forward_pre_hook(_mask_hook, with_kwargs=True)
        return out

    initialize._zorro_e2e = True
    cls.initialize = initialize
    _patch_megatron_reload(module)


def _patch_megatron_reload(module) -> None:
    """verl's ``load_megatron_model_to_gpu`` (brings offloaded parameters back before a forward or a weight export)
    reads each DDP buffer's ``param_data``, which megatron-core leaves ``None`` without the distributed optimizer
    (the buffer's parameters are not remapped, nothing was offloaded): such buffers are skipped for the call."""
    import verl.utils.megatron_utils as mu

    orig = mu.load_megatron_model_to_gpu
    if getattr(orig, "_zorro_e2e", False):
        return
    from megatron.core.distributed import DistributedDataParallel as DDP

    def load_megatron_model_to_gpu(models, *args, **kwargs):
        skipped = []
        for chunk in models:
            if isinstance(chunk, DDP):
                for buffers in (chunk.buffers, chunk.expert_parallel_buffers):
                    for buffer in buffers:
                        if buffer.param_data is None:
                            skipped.append((buffers, buffer))
        for buffers, buffer in skipped:
            buffers.remove(buffer)
        try:
            return orig(models, *args, **kwargs)
        finally:
            for buffers, buffer in skipped:
                buffers.append(buffer)

    load_megatron_model_to_gpu._zorro_e2e = True
    mu.load_megatron_model_to_gpu = load_megatron_model_to_gpu
    module.load_megatron_model_to_gpu = load_megatron_model_to_gpu


#: set (to anything): verl's stock engine computes log-probs with tests.support.cpu_stock_kernels.blocked_logprobs
STOCK_KERNELS_ENV = "ZORRO_E2E_STOCK_KERNELS"
#: seconds between the V1 replay buffer's polls for finished rollouts (verl's default 2.0 rounds the ``gen`` phase,
#: and so the step time, up to whole polls; the e2e benchmark sets 0.05 for both runs it compares)
POLL_INTERVAL_ENV = "ZORRO_E2E_POLL_INTERVAL"


def _patch_replay_poll(module) -> None:
    """With :data:`POLL_INTERVAL_ENV` set, the V1 replay buffer polls for finished rollouts that often."""
    poll = os.environ.get(POLL_INTERVAL_ENV)
    base = getattr(module, "ReplayBuffer", None)
    if not poll or base is None or getattr(base.__init__, "_zorro_e2e", False):
        return
    orig_init = base.__init__

    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        self.poll_interval = float(poll)

    __init__._zorro_e2e = True
    base.__init__ = __init__


def _patch_replay_order(module) -> None:
    """The V1 replay buffer hands out a step's samples in the order their rollouts finished (asynchronous agent
    loops, timing-dependent); verl's balancing then cuts mini-batches from that order, so two runs on the same
    rollouts would put different rows in an optimizer step. Sort each sampled batch by ``(uid, session, index)``
    (the key ``{uid}_{session}_{index}``; uids are sequential, :func:`_patch_uids`): dataset order."""

    def order_key(key: str):
        uid, session, index = str(key).rsplit("_", 2)
        return uid, int(session), int(index)

    for cls in (getattr(module, "ReplayBuffer", None), getattr(module, "ReplayBufferAsync", None)):
        if cls is None or getattr(cls.sample, "_zorro_e2e", False) or "sample" not in vars(cls):
            continue
        orig = cls.sample

        def sample(self, *args, _orig=orig, **kwargs):
            batch, metrics = _orig(self, *args, **kwargs)
            idx = sorted(range(len(batch.keys)), key=lambda i: order_key(batch.keys[i]))
            batch.reorder(idx)
            return batch, metrics

        sample._zorro_e2e = True
        cls.sample = sample


def install_ordered_batches() -> None:
    """Deterministic samples and batch order: sequential uids (both trainers), each V1 sampled batch sorted by key,
    and each request seeded (and recorded or replayed) by its sample's uid, session and turn; the replay buffer's
    poll interval from :data:`POLL_INTERVAL_ENV` when set."""
    _after_import("verl.trainer.ppo.v1.trainer_base", _patch_uids)
    _after_import("verl.trainer.ppo.ray_trainer", _patch_uids)
    _after_import("verl.trainer.ppo.v1.replay_buffer", _patch_replay_order)
    _after_import("verl.trainer.ppo.v1.replay_buffer", _patch_replay_poll)
    _after_import("verl.experimental.agent_loop.agent_loop", _patch_agent_loop)
    _after_import("verl.workers.rollout.llm_server", _patch_llm_client)


def install_seeded_rollout() -> None:
    """Per-request vLLM seeds from (prompt tokens, occurrence count): reproducible rollouts across runs."""
    _after_import("verl.workers.rollout.vllm_rollout.vllm_async_server", _patch_vllm_server)


def install() -> None:
    """Register and select the CPU platform, patch the process group, FSDP1's module-state sync and FSDP2's offload
    policy (idempotent)."""
    global _installed
    if _installed:
        return
    if torch.cuda.is_available():
        raise RuntimeError("zorro e2e CPU setup: CUDA is available on this host; refusing to run verl on the CPU.")
    from verl.plugin.platform import PlatformRegistry, set_platform

    cls = PlatformRegistry.get("cpu")
    if cls is None or cls.__name__ != "PlatformCPUE2E":
        cls = PlatformRegistry.register(platform="cpu")(_platform_class())
    set_platform(cls())
    _patch_process_group()
    from tests.support.fsdp1_cpu import allow_cpu_fsdp1

    allow_cpu_fsdp1()
    _patch_offload_policy()
    from tests.support.cpu_stock_kernels import register, use_blocked_logprobs

    register()  # attn_implementation=cpu_varlen (the e2e benchmark's stand-in for flash varlen)
    if os.environ.get(STOCK_KERNELS_ENV):
        _after_import("verl.workers.engine.fsdp.transformer_impl", use_blocked_logprobs)
    _after_import("verl.workers.rollout.vllm_rollout.bucketed_weight_transfer", _patch_weight_receiver)
    _after_import("vllm.model_executor.layers.utils", _patch_vllm_cpu_gemm)
    _after_import("vllm.distributed.device_communicators.shm_broadcast", _patch_vllm_idle_spin)
    _after_import("verl.utils.model", _patch_value_model_loader)
    if os.environ.get(MEGATRON_ENV):
        _after_import("verl.workers.config.engine", _patch_mcore_fp32)
        _before_import("verl.workers.engine.megatron", _megatron_setup)
        _after_import("verl.workers.engine.megatron.transformer_impl", _patch_megatron_bshd_mask)  # + the reload
    install_seeded_rollout()
    install_ordered_batches()
    from tests.support.heap_peak import start as start_heap_peak

    start_heap_peak()  # with ZORRO_E2E_HEAP_DIR (the e2e benchmark): a training worker's peak heap in use
    _installed = True


def e2e_env(n_threads: int = 1) -> dict:
    """Environment of a ``main_ppo`` subprocess (inherited by its Ray cluster): this repository first on the path (so
    ``tests`` is this repository's package, not the one verl's wheel installs), the plugin loaded at ``import verl``,
    the CPU engine key, and vLLM's CPU settings (1 GiB KV cache, no thread binding)."""
    path = os.environ.get("PYTHONPATH", "")
    return {
        "PYTHONPATH": str(REPO_ROOT) + (os.pathsep + path if path else ""),
        "VERL_USE_EXTERNAL_MODULES": "tests.support.verl_cpu_e2e_plugin",
        "VERL_ENGINE_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(n_threads),
        "MKL_NUM_THREADS": str(n_threads),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_DEDUP_LOGS": "0",
        "PYTHONUNBUFFERED": "1",
    }


def cpu_overrides(n_workers: int) -> list[str]:
    """Hydra overrides that make ``main_ppo`` run on the CPU: Ray with ``n_workers`` logical GPUs (and logical CPUs
    enough for placement groups and TransferQueue actors) and without its dashboard, non-flash attention, vLLM
    without sleep mode and CUDA graphs, a small shared-memory weight-sync bucket (the default makes a 2 GB
    ``/dev/shm`` segment), one TransferQueue storage unit (the default eight hang a small Ray cluster)."""
    return [
        "trainer.device=cpu",
        f"trainer.n_gpus_per_node={n_workers}",
        "trainer.nnodes=1",
        f"+ray_kwargs.ray_init.num_gpus={n_workers}",
        "ray_kwargs.ray_init.num_cpus=16",
        # no dashboard process (nothing here reads it; one Python process fewer per run, and no port 8265 to share
        # between two runs side by side)
        "+ray_kwargs.ray_init.include_dashboard=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "+actor_rollout_ref.rollout.enable_sleep_mode=False",
        "actor_rollout_ref.rollout.enforce_eager=True",
        "actor_rollout_ref.rollout.free_cache_engine=False",
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=16",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]

