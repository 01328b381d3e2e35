"""OpenRLHF's own training loop (``ActorPPOTrainer.ppo_train`` -> ``training_step``) with zorro's batching installed
by the loader's hooks, against the same loop without them.

Each DP rank's buffer is OpenRLHF's ``NaiveReplayBuffer`` fed the experience maker's micro-batches (contiguous chunks
over ranks, as ``RayActorGroup.async_run_method_batch`` hands them out), every rank seeded alike (OpenRLHF's
``set_seed``). ``ppo_train`` builds its ``DataLoader``, draws the sampler's permutation from torch's generator and
groups micro-batches into optimizer steps with ``iter_grad_accum_global_norm``. The strategy stands in for
DeepSpeed on one process: each backward scales the loss by ``1 / accumulated_gradient`` and the optimizer steps every
``accumulated_gradient`` micro-batches (DeepSpeed's gradient accumulation); collectives are the identity (one rank
at a time). Trainers are built without ``__init__`` (it opens the vLLM weight-sync group).
"""

import logging
from types import SimpleNamespace

import pytest
import torch

from tests.integrations.openrlhf.conftest import require_openrlhf_env

require_openrlhf_env()

from tests.support.openrlhf_imports import import_ppo_actor  # noqa: E402

ppo_actor, launcher = import_ppo_actor()

from openrlhf.models.actor import Actor  # noqa: E402
from openrlhf.models.loss import PolicyLoss  # noqa: E402
from openrlhf.trainer.ppo_utils import replay_buffer as rb_module  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402

from zorro_verl.integrations.openrlhf import actor as zactor  # noqa: E402
from zorro_verl.integrations.openrlhf import batching, boot  # noqa: E402
from zorro_verl.integrations.openrlhf import layout as zlayout  # noqa: E402
from zorro_verl.integrations.verl.settings import ZorroSettings  # noqa: E402
from zorro_verl.packing.microbatch import microbatch_cost  # noqa: E402
from zorro_verl.testing.compare import max_rel_grad_error  # noqa: E402
from zorro_verl.testing.fp64 import exact_fp64_norms  # noqa: E402
from zorro_verl.testing.models import tiny_config  # noqa: E402

# The training runs compare in fp64 (docs/design/openrlhf.md, its tests): in fp32, six SGD steps at lr 0.5 grow one
# step's ~1e-6 rounding to ~1e-5, more or less than that by the CPU's kernels; in fp64 they stay near 1e-14.
TOL = 1e-9
VOCAB = 128


def rollout(n: int, prompts: int, seed: int = 0, old_from=None):
    """Single-sample Experiences as OpenRLHF's experience maker leaves them: ``sequences [1, L]``, ``action_mask
    [1, L - 1]`` on the response, old / reference log-probs and advantages ``[1, L - 1]``. Prompt lengths 3..9,
    responses 1..6 tokens, the n samples of a prompt together."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(prompts):
        prompt = torch.randint(1, 100, (3 + (5 * k) % 7,), generator=g)
        for _ in range(n):
            r = int(torch.randint(1, 7, (1,), generator=g))
            seq = torch.cat([prompt, torch.randint(1, 100, (r,), generator=g)])
            act = torch.zeros(len(seq) - 1, dtype=torch.long)
            act[len(prompt) - 1:] = 1
            old = -2.0 - torch.rand(len(seq) - 1, generator=g)
            adv = (torch.rand(1, generator=g) + 0.5).expand(len(seq) - 1).clone()
            out.append(Experience(
                sequences=seq[None], attention_mask=torch.ones(1, len(seq), dtype=torch.long), action_mask=act[None],
                action_log_probs=(old * act)[None], base_action_log_probs=((old - 0.1) * act)[None],
                advantages=(adv * act)[None], rewards=torch.rand(1, generator=g), response_length=torch.tensor([r]),
                total_length=torch.tensor([float(len(seq))]), prompts=[f"p{k}"], info={}))
    return out


def key_of(seq, am, act):
    """``(prompt tokens, sample tokens)`` of one row."""
    s = seq[am.bool()]
    first = int(act.nonzero()[0]) + 1
    return tuple(s[:first].tolist()), tuple(s.tolist())


def rows_of(exp):
    return [key_of(s, m, a) for s, m, a in zip(exp.sequences, exp.attention_mask, exp.action_mask)]


def trainer_args(n: int, micro: int, epochs: int):
    return SimpleNamespace(
        train=SimpleNamespace(dynamic_batch_enable=False, max_epochs=epochs, micro_batch_size=micro),
        ds=SimpleNamespace(tensor_parallel_size=1, ring_attn_size=1, packing_samples=False),
        actor=SimpleNamespace(entropy_coef=0.01, aux_loss_coef=0.0),
        algo=SimpleNamespace(kl=SimpleNamespace(use_loss=True, init_coef=0.01, estimator="k3",
                                                unbiased_gradient=False)),
        rollout=SimpleNamespace(n_samples_per_prompt=n, micro_batch_size=2 * n))


class OneRankStrategy:
    """DeepSpeed's gradient accumulation on one process: ``backward`` scales the loss by ``1 / gas``;
    ``optimizer_step`` (called after every micro-batch) steps at every ``gas``-th call and records each step's
    gradients first."""

    def __init__(self, args, gas: int):
        self.args, self.accumulated_gradient, self.ring_attn_group = args, gas, None
        self.calls, self.step_grads, self.reduce_ops = 0, [], []

    def is_rank_0(self):
        return False  # no progress bar

    def all_reduce(self, data, op="mean"):
        self.reduce_ops.append(op)
        return data

    def backward(self, loss, model, optimizer):
        (loss / self.accumulated_gradient).backward()

    def optimizer_step(self, optimizer, model, scheduler, name="model"):
        self.calls += 1
        if self.calls % self.accumulated_gradient == 0:
            self.step_grads.append({k: p.grad.detach().clone() for k, p in model.model.named_parameters()
                                    if p.grad is not None})
            optimizer.step()
            optimizer.zero_grad()

    def get_grad_norm(self, model):
        return 0.0


def make_trainer(args, strategy, buffer, actor=None, optim=None):
    t = ppo_actor.ActorPPOTrainer.__new__(ppo_actor.ActorPPOTrainer)
    t.strategy, t.args, t.replay_buffer, t.max_epochs = strategy, args, buffer, args.train.max_epochs
    t.dataloader_pin_memory, t.actor, t.ema_model, t.actor_optim, t.aux_loss = False, actor, None, optim, False
    t.actor_scheduler = SimpleNamespace(get_last_lr=lambda: [0.0])
    t.actor_loss_fn = PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28, token_level_loss=True)
    return t


def new_buffer(monkeypatch, micro, samples, per_experience):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the buffer's target device: cuda:0, unused
    buffer = rb_module.NaiveReplayBuffer(micro, 0, True, False, False)
    for i in range(0, len(samples), per_experience):
        buffer.append(Experience.concat_experiences(samples[i: i + per_experience], 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # ppo_train moves batches here
    return buffer


@pytest.fixture
def zorro_batching(monkeypatch):
    """Install zorro's batching the way the loader does (its post-import hooks on the real modules, options from
    the environment) for one mode; restore OpenRLHF after."""
    cls, rb = ppo_actor.ActorPPOTrainer, rb_module.NaiveReplayBuffer
    saved = (cls.__dict__["ppo_train"], ppo_actor.iter_grad_accum_global_norm)
    rb_saved = {k: v for k, v in rb.__dict__.items() if callable(v)}
    flags = {c: c.__dict__.get("_zorro_installed") for c in (cls, rb)}

    def install(mode="keep_minibatches"):
        monkeypatch.setenv("ZORRO_OPENRLHF", "1")
        monkeypatch.setenv("ZORRO_OPENRLHF_OPTIONS", f"group_balance_mode={mode}")
        boot.on_ppo_actor_module(ppo_actor)
        boot.on_replay_buffer_module(rb_module)

    try:
        yield install
    finally:
        cls.ppo_train, ppo_actor.iter_grad_accum_global_norm = saved
        for k, v in rb_saved.items():
            setattr(rb, k, v)
        for c, v in flags.items():
            if v is None:
                c.__dict__.get("_zorro_installed") is not None and delattr(c, "_zorro_installed")
            else:
                c._zorro_installed = v
        cls.__dict__.get("_zorro_warned_mode") is not None and delattr(cls, "_zorro_warned_mode")
        batching.pop_split_counts()


def record_run(monkeypatch, samples, ranks, n, micro, gas, epochs, seed):
    """Run ``ppo_train`` on every rank with a recording ``training_step``. Returns, per rank, the list of
    ``(rows, loss_batch_info)`` of every micro-batch in order, and torch's RNG state after each rank's run."""
    args = trainer_args(n, micro, epochs)
    per_exp = 2 * n
    exps = -(-len(samples) // per_exp)
    chunk = -(-exps // ranks)
    out, rng = [], []
    for r in range(ranks):
        mine = samples[r * chunk * per_exp:(r + 1) * chunk * per_exp]
        torch.manual_seed(seed)  # every rank seeds alike
        buffer = new_buffer(monkeypatch, micro, mine, per_exp)
        trainer = make_trainer(args, OneRankStrategy(args, gas), buffer)
        log = []

        def training_step(experience, kl_ctl, step, loss_batch_info, log=log):
            log.append((rows_of(experience), {k: float(v) for k, v in loss_batch_info.items()}))
            return {"metrics": {"policy_loss": torch.tensor(0.0)}, "weights": {"policy_loss": "token"},
                    "num_samples": float(len(experience.sequences)),
                    "num_action_tokens": float(experience.action_mask.sum())}

        trainer.training_step = training_step
        trainer.ppo_train(0.0)
        out.append(log)
        rng.append(torch.get_rng_state())
    return out, rng


def steps_of(log, gas, epochs=1):
    """The optimizer steps of a run: each epoch's micro-batches in windows of ``gas`` (the last one shorter when
    the epoch's count is not a multiple, as OpenRLHF's trailing partial step)."""
    per = len(log) // epochs
    return [log[e * per + i: e * per + min(i + gas, per)] for e in range(epochs) for i in range(0, per, gas)]


def pieces(rows):
    """Group pieces in a micro-batch (each pays its prompt once)."""
    return len({p for p, _ in rows})


@pytest.mark.parametrize("n,prompts,micro,gas,ranks,epochs", [
    (4, 12, 4, 3, 1, 2),  # 4 steps per epoch
    (4, 12, 8, 2, 2, 2),  # per rank 3 micro-batches: a step of 2 and OpenRLHF's trailing partial step of 1
    (3, 12, 4, 3, 1, 1),  # micro-batch size not a multiple of n
    (2, 16, 2, 4, 2, 1)])
def test_optimizer_steps_equal_stock(zorro_batching, monkeypatch, n, prompts, micro, gas, ranks, epochs):
    """Default mode: every optimizer step of every rank (several per rollout, every epoch) trains on exactly stock's
    samples with stock's loss normalisers and micro-batch sizes; torch's generator ends in stock's state (no extra
    draw); inside steps, groups share micro-batches more than stock's sample-level shuffle gives."""
    samples = rollout(n, prompts=prompts, seed=1)
    stock, stock_rng = record_run(monkeypatch, samples, ranks, n, micro, gas, epochs, seed=3)
    zorro_batching("keep_minibatches")
    zorro, zorro_rng = record_run(monkeypatch, samples, ranks, n, micro, gas, epochs, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(stock_rng, zorro_rng))
    s_pieces = z_pieces = 0
    for s_log, z_log in zip(stock, zorro):
        assert [len(rows) for rows, _ in z_log] == [len(rows) for rows, _ in s_log]
        s_steps, z_steps = steps_of(s_log, gas, epochs), steps_of(z_log, gas, epochs)
        assert len(s_steps) >= 2 * epochs  # several optimizer steps per rollout
        for s_step, z_step in zip(s_steps, z_steps):
            assert sorted(k for rows, _ in z_step for k in rows) == sorted(k for rows, _ in s_step for k in rows)
            assert all(info == s_step[0][1] for _, info in z_step)
            s_pieces += sum(pieces(rows) for rows, _ in s_step)
            z_pieces += sum(pieces(rows) for rows, _ in z_step)
    assert z_pieces < s_pieces, (z_pieces, s_pieces)
    # the 2-rank steps: the union over ranks is stock's too (each rank's part is)
    if ranks == 2:
        for k in range(len(steps_of(stock[0], gas, epochs))):
            union = [sorted(x for log in logs for rows, _ in steps_of(log, gas, epochs)[k] for x in rows)
                     for logs in (stock, zorro)]
            assert union[0] == union[1]


def composition(log):
    """Which prompt groups share a micro-batch (in any order of the micro-batches)."""
    return tuple(sorted(tuple(sorted({p for p, _ in rows})) for rows, _ in log))


@pytest.mark.parametrize("mode", ["keep_minibatches", "whole_groups"])
def test_composition_random_by_seed_and_epoch(zorro_batching, monkeypatch, mode):
    """Which groups share a micro-batch is drawn from the run's seed (the stock sampler's permutation) and redrawn
    every epoch, as stock reshuffles (not fixed by the lengths)."""
    zorro_batching(mode)
    samples = rollout(4, prompts=8, seed=2)
    comps, new_epoch = set(), 0
    for seed in range(20):
        (log,), _ = record_run(monkeypatch, samples, 1, 4, 8, 2, 2, seed=seed)
        half = len(log) // 2
        comps.add(composition(log[:half]))
        new_epoch += composition(log[:half]) != composition(log[half:])
    assert len(comps) >= 15, len(comps)
    assert new_epoch >= 15, new_epoch


def test_whole_groups_mode(zorro_batching, monkeypatch, caplog):
    """The opt-in: whole groups in every micro-batch, each epoch on stock's samples, OpenRLHF's normalisers over the
    new steps; warned once; other samples share a step than in stock (documented)."""
    n, micro, gas = 4, 8, 2
    samples = rollout(n, prompts=8, seed=4)
    stock, stock_rng = record_run(monkeypatch, samples, 1, n, micro, gas, 2, seed=5)
    zorro_batching("whole_groups")
    with caplog.at_level(logging.WARNING):
        zorro, zorro_rng = record_run(monkeypatch, samples, 1, n, micro, gas, 2, seed=5)
        record_run(monkeypatch, samples, 1, n, micro, gas, 1, seed=6)
    assert sum("whole_groups" in r.getMessage() for r in caplog.records) == 1
    assert torch.equal(stock_rng[0], zorro_rng[0])
    (s_log,), (z_log,) = stock, zorro
    half = len(s_log) // 2
    for part in (slice(None, half), slice(half, None)):  # each epoch trains on stock's samples
        assert sorted(k for rows, _ in z_log[part] for k in rows) == sorted(k for rows, _ in s_log[part] for k in rows)
    for rows, _ in z_log:
        assert len(rows) == micro and all(sum(p == q for q, _ in rows) == n for p, _ in rows)  # whole groups
    for step in steps_of(z_log, gas, 2):  # OpenRLHF's token normaliser of the new step: its action tokens / gas
        tokens = sum(len(s) - len(p) for rows, _ in step for p, s in rows)
        assert all(info["batch_num_tokens"] == tokens / gas for _, info in step)
    assert any(sorted(k for rows, _ in zs for k in rows) != sorted(k for rows, _ in ss for k in rows)
               for zs, ss in zip(steps_of(z_log, gas, 2), steps_of(s_log, gas, 2)))


# ------------------------------------------------------------------------------------------------ a training run
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("qwen3", vocab_size=VOCAB)
    cfg.initializer_range = 0.2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path = tmp_path_factory.mktemp("qwen3_tiny_steps")
    model.save_pretrained(path)
    return str(path), {k: v.double() for k, v in model.state_dict().items()}


class Fp64Torch:
    """``torch`` as ``openrlhf.models.actor`` sees it, with ``float32`` standing for fp64: the stock forward's
    logits cast (``output["logits"].to(torch.float32)``) then keeps an fp64 model's logits in fp64 (test only)."""

    float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


@pytest.fixture
def fp64_logits(monkeypatch):
    """OpenRLHF's log-probs in the model's fp64 on both sides: the stock forward's fp32 cast of the logits
    (:class:`Fp64Torch`) and zorro's output dtype, which follows it (``layout.OUTPUT_DTYPE``). Everything else of
    both paths runs as shipped."""
    import openrlhf.models.actor as actor_module

    monkeypatch.setattr(actor_module, "torch", Fp64Torch())
    monkeypatch.setattr(zlayout, "OUTPUT_DTYPE", torch.float64)


def fp64_actor_of(checkpoint):
    """A real ``Actor`` on the checkpoint's weights in fp64, RMSNorm kept in fp64 (``exact_fp64_norms``: transformers
    casts to fp32 there), zorro's state on it (sdpa)."""
    path, state = checkpoint
    actor = Actor(path, attn_implementation="sdpa", param_dtype="bf16", temperature=0.9)
    actor.model.double()
    actor.model.load_state_dict(state)
    exact_fp64_norms(actor.model)
    zactor.actor_state(actor, ZorroSettings(enable=True, attention_backend="sdpa"))
    return actor


def train(checkpoint, monkeypatch, samples, n, micro, gas, epochs, seed):
    """``ppo_train`` on a real ``Actor`` (fp64, SGD): per optimizer step gradients and the final weights."""
    actor = fp64_actor_of(checkpoint)
    args = trainer_args(n, micro, epochs)
    strategy = OneRankStrategy(args, gas)
    optim = torch.optim.SGD(actor.model.parameters(), lr=0.5)
    torch.manual_seed(seed)
    buffer = new_buffer(monkeypatch, micro, samples, 2 * n)
    make_trainer(args, strategy, buffer, actor, optim).ppo_train(0.01)
    return strategy.step_grads, {k: v.detach().clone() for k, v in actor.model.named_parameters()}


def test_training_run_matches_stock(zorro_batching, checkpoint, fp64_logits, monkeypatch):
    """Several optimizer steps (2 per epoch, 2 epochs) of OpenRLHF's own training loop on a real Actor: zorro's
    forward and batching against stock's; every step's gradient of every parameter and the final weights agree to
    1e-9 (relative, fp64)."""
    n, micro, gas = 4, 4, 3
    samples = rollout(n, prompts=6, seed=7)
    zactor.uninstall(Actor)
    s_grads, s_weights = train(checkpoint, monkeypatch, samples, n, micro, gas, 2, seed=11)
    zorro_batching("keep_minibatches")
    zactor.install(Actor)
    try:
        z_grads, z_weights = train(checkpoint, monkeypatch, samples, n, micro, gas, 2, seed=11)
    finally:
        zactor.uninstall(Actor)
    assert len(s_grads) == len(z_grads) == 4
    errs = [max_rel_grad_error(a, b) for a, b in zip(s_grads, z_grads)]
    assert max(e for e, _ in errs) <= TOL, errs
    w_err, name = max_rel_grad_error(s_weights, z_weights)
    assert w_err <= TOL, (w_err, name)
    moved, _ = max_rel_grad_error(s_weights, dict(checkpoint[1]))
    assert moved > 1e-3  # the steps did move the weights


@pytest.fixture
def gloo_one_rank(tmp_path):
    """OpenRLHF's setup_dynamic_batch all-reduces over the DP group: a one-rank gloo world."""
    import torch.distributed as dist

    if not dist.is_initialized():
        # a file rendezvous: no TCP port that another process could hold
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def train_dynamic(checkpoint, monkeypatch, samples, n, epochs, max_tokens):
    """``ppo_train`` with ``--train.dynamic_batch_enable`` on a real Actor: DeepSpeed's gas is 1 there and OpenRLHF
    steps on each window's last partition (fp64, SGD)."""
    actor = fp64_actor_of(checkpoint)
    args = trainer_args(n, 1, epochs)
    args.train.dynamic_batch_enable, args.train.batch_size, args.train.max_tokens_per_gpu = True, 8, max_tokens
    args.rollout.batch_size = len(samples) // n
    strategy = OneRankStrategy(args, 1)
    strategy.ds_device_mesh = {"dp": SimpleNamespace(get_group=lambda: None)}
    optim = torch.optim.SGD(actor.model.parameters(), lr=0.5)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    buffer = rb_module.NaiveReplayBuffer(1, 0, True, False, True)
    for i in range(0, len(samples), 2 * n):
        buffer.append(Experience.concat_experiences(samples[i: i + 2 * n], 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    make_trainer(args, strategy, buffer, actor, optim).ppo_train(0.01)
    return strategy.step_grads, {k: v.detach().clone() for k, v in actor.model.named_parameters()}, buffer


def test_dynamic_training_run_matches_stock(zorro_batching, checkpoint, fp64_logits, gloo_one_rank, monkeypatch):
    """Dynamic batching: OpenRLHF's own loop with its length-balanced partitions against zorro's per-step partitions
    on deduplicated tokens (the actor's buffer) and zorro's forward: every step's gradients and the final weights
    agree to 1e-9 (relative, fp64), with fewer, larger partitions."""
    n = 4
    samples = rollout(n, prompts=6, seed=9)
    zactor.uninstall(Actor)
    s_grads, s_weights, s_buf = train_dynamic(checkpoint, monkeypatch, samples, n, 2, max_tokens=40)
    zorro_batching("keep_minibatches")
    zactor.install(Actor)
    try:
        z_grads, z_weights, z_buf = train_dynamic(checkpoint, monkeypatch, samples, n, 2, max_tokens=40)
    finally:
        zactor.uninstall(Actor)
    assert len(s_grads) == len(z_grads) == 6  # 3 steps per epoch
    assert len(z_buf.dynamic_indices) < len(s_buf.dynamic_indices)
    errs = [max_rel_grad_error(a, b) for a, b in zip(s_grads, z_grads)]
    assert max(e for e, _ in errs) <= TOL, errs
    w_err, name = max_rel_grad_error(s_weights, z_weights)
    assert w_err <= TOL, (w_err, name)
    moved, _ = max_rel_grad_error(s_weights, dict(checkpoint[1]))
    assert moved > 1e-3  # the steps did move the weights


# ------------------------------------------------------------------------------------------------ metrics
class Counted:
    """An object carrying zorro's per-Actor counters (what ``zorro_forward`` fills)."""

    def __init__(self, ordinary, dedup, fallback=0):
        self.__dict__["_zorro_state"] = SimpleNamespace(counts={
            "ordinary_tokens": ordinary, "dedup_tokens": dedup, "fallback_batches": fallback, "calls": 1})


def test_policy_metrics_summed_over_ranks(zorro_batching, monkeypatch):
    """``zorro/*`` in the status of ppo_train come from the counters summed over all policy ranks (the strategy's
    all-reduce, op sum), with the training micro-batches' split groups of all ranks."""
    zorro_batching("keep_minibatches")
    other_rank = {"ordinary_tokens": 300.0, "dedup_tokens": 100.0, "fallback_batches": 1.0, "split_groups": 2.0}

    class TwoRanks(OneRankStrategy):
        def all_reduce(self, data, op="mean"):
            self.reduce_ops.append(op)
            if isinstance(data, dict) and set(data) == set(other_rank):
                assert op == "sum"
                return {k: v + other_rank[k] for k, v in data.items()}
            return data

    args = trainer_args(4, 4, 1)
    samples = rollout(4, prompts=4, seed=8)
    strategy = TwoRanks(args, 2)
    trainer = make_trainer(args, strategy, new_buffer(monkeypatch, 4, samples, 8), actor=Counted(100, 60))
    trainer.training_step = lambda e, kl, step, info: {
        "metrics": {"policy_loss": torch.tensor(0.0)}, "weights": {"policy_loss": "token"},
        "num_samples": 1.0, "num_action_tokens": 1.0}
    batching.pop_split_counts()
    status = trainer.ppo_train(0.0)
    split_here = status["zorro/split_groups"] - 2.0
    assert split_here >= 0
    assert status["zorro/dedup_ratio"] == pytest.approx(400 / 160)
    assert status["zorro/prompt_tokens_saved"] == 240.0
    assert status["zorro/fallback_batches"] == 1.0
    assert "sum" in strategy.reduce_ops


def test_trainer_metrics_include_reference_and_experience_maker(monkeypatch):
    """The trainer's status gains the experience maker's split groups (its micro-batches and the DP balancing) and
    the reference model's counters from all its Ray actors, read through OpenRLHF's own
    ``BaseModelActor.execute_batch``."""
    monkeypatch.setenv("ZORRO_OPENRLHF", "1")
    monkeypatch.delenv("ZORRO_OPENRLHF_OPTIONS", raising=False)
    had = "zorro_counts" in launcher.BaseModelActor.__dict__
    boot.on_model_actors_module(launcher)
    try:
        refs = []
        for counts in ((120, 50), (80, 30)):
            a = launcher.BaseModelActor.__new__(launcher.BaseModelActor)
            a.model, a.strategy = Counted(*counts), SimpleNamespace(is_rank_0=lambda: False)
            refs.append(a)

        class Group:  # RayActorGroup.async_run_method over in-process actors (ray.get: the identity here)
            def async_run_method(self, method_name, *args, **kwargs):
                return [getattr(a, method_name)(*args, **kwargs) for a in refs]

        import ray

        monkeypatch.setattr(ray, "get", lambda x: x)

        class Trainer:
            def train_step(self, rollout_samples, global_step):
                return {"policy_loss": 1.0}, global_step + 1

        Trainer.train_step = zactor.with_trainer_metrics(Trainer.train_step)
        t = Trainer()
        t.experience_maker = SimpleNamespace(zorro_split_groups=3)
        t.reference_model_group = Group()
        batching.pop_split_counts()
        batching._SPLIT["balance"] += 2
        status, step = t.train_step([], 7)
        assert step == 8 and status["policy_loss"] == 1.0
        assert status["zorro/experience_split_groups"] == 5.0 and t.experience_maker.zorro_split_groups == 0
        assert status["zorro/ref_dedup_ratio"] == pytest.approx(200 / 80)
        assert status["zorro/ref_prompt_tokens_saved"] == 120.0
        status, _ = t.train_step([], 8)  # counters were reset
        assert status["zorro/ref_prompt_tokens_saved"] == 0.0 and status["zorro/experience_split_groups"] == 0.0
        del launcher.BaseModelActor.zorro_counts  # a reference worker that did not load zorro: loud
        with pytest.raises(RuntimeError, match="did not run zorro's OpenRLHF loader"):
            t.train_step([], 9)
    finally:
        if not had and "zorro_counts" in launcher.BaseModelActor.__dict__:
            del launcher.BaseModelActor.zorro_counts


@pytest.mark.parametrize("rollout_micro,train_micro,warned", [(8, 1, ["--train.micro_batch_size"]),
                                                               (6, 8, ["--rollout.micro_batch_size"]),
                                                               (8, 4, [])])
def test_micro_batch_size_warning(monkeypatch, caplog, rollout_micro, train_micro, warned):
    """At start-up (the experience maker's argument check): a fixed micro-batch size that is not a multiple of n
    is warned once (OpenRLHF's default of 1 deduplicates nothing in training)."""
    monkeypatch.setattr(batching, "_WARNED_SIZES", set(), raising=False)
    args = SimpleNamespace(rollout=SimpleNamespace(n_samples_per_prompt=4, micro_batch_size=rollout_micro),
                           train=SimpleNamespace(micro_batch_size=train_micro, dynamic_batch_enable=False),
                           ds=SimpleNamespace(ring_attn_size=1, tensor_parallel_size=1),
                           actor=SimpleNamespace(aux_loss_coef=0.0))
    with caplog.at_level(logging.WARNING):
        zactor.check_args(args, ZorroSettings(enable=True))
        zactor.check_args(args, ZorroSettings(enable=True))
    msgs = [r.getMessage() for r in caplog.records if "not a multiple" in r.getMessage()]
    assert [m.split()[1] for m in msgs] == warned
    if train_micro == 1:
        assert "nothing is deduplicated" in msgs[0]


def test_pack_in_order_sizes_and_cuts():
    """The packer: exact sizes, groups whole where they fit, cuts counted, composition set by the row order."""
    g = [0, 0, 0, 1, 1, 2, 2, 2, 2, 3]
    p, r = [5] * 10, [1] * 10
    gb = batching.pack_in_order(g, p, r, [4, 4, 2])
    assert sorted(len(b) for b in gb.batches) == [2, 4, 4]
    assert sorted(x for b in gb.batches for x in b) == list(range(10))
    owners = {}
    for k, b in enumerate(gb.batches):
        for i in b:
            owners.setdefault(g[i], set()).add(k)
    assert gb.split_groups == sum(len(v) > 1 for v in owners.values())
    assert all(microbatch_cost(b, g, p, r) >= 1 for b in gb.batches)
    with pytest.raises(ValueError, match="sizes"):
        batching.pack_in_order(g, p, r, [4, 4])
