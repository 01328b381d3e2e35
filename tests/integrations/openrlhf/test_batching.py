"""Group-aware batching on OpenRLHF's real replay buffer, Experience collation, experience-maker inputs and DP
balancing (dynamic batching). The training steps through ``ActorPPOTrainer.ppo_train`` are in
``test_training_steps.py``.

The buffer is OpenRLHF's ``NaiveReplayBuffer`` (zorro's ``setup_dynamic_batch`` installed where said), fed
``Experience`` batches as the experience maker produces them. Its constructor asks ``torch.cuda.current_device()``
for its target device; on CPU the tests answer 0.
"""

import logging
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

from tests.integrations.openrlhf.conftest import require_openrlhf_env

require_openrlhf_env()

from openrlhf.trainer.ppo_utils import replay_buffer as rb_module  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402

from zorro_verl.integrations.openrlhf import batching  # noqa: E402
from zorro_verl.packing.microbatch import microbatch_cost  # noqa: E402


def rollout_samples(n: int, prompts: int, seed: int = 0, prompt_lens=(6, 3, 9, 4, 5, 7)):
    """Single-sample Experiences as OpenRLHF's samples generator builds them: the n samples of a prompt arrive
    together, ``sequences [1, L]``, ``action_mask [1, L-1]`` shifted by one, responses of 1..6 tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(prompts):
        prompt = torch.randint(1, 100, (prompt_lens[k % len(prompt_lens)],), generator=g)
        for _ in range(n):
            r = int(torch.randint(1, 7, (1,), generator=g))
            seq = torch.cat([prompt, torch.randint(1, 100, (r,), generator=g)])
            am = torch.ones(len(seq), dtype=torch.long)
            act = torch.zeros(len(seq), dtype=torch.long)
            act[len(prompt): len(seq)] = 1
            out.append(Experience(sequences=seq[None], attention_mask=am[None], action_mask=act[1:][None],
                                  rewards=torch.rand(1, generator=g), response_length=torch.tensor([r]),
                                  total_length=torch.tensor([float(len(seq))]), prompts=[f"p{k}"], info={}))
    return out


def prompt_of(seq: torch.Tensor, act: torch.Tensor) -> tuple:
    first = int(act.nonzero()[0]) + 1
    return tuple(seq[:first].tolist())


#: OpenRLHF's own buffer methods while zorro's are installed (filled by the ``zorro_buffer`` fixture).
STOCK_METHODS: dict = {}


@pytest.fixture
def zorro_buffer(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cls = rb_module.NaiveReplayBuffer
    saved = {k: cls.__dict__[k] for k in ("__init__", "append", "clear", "__len__", "__getitem__", "collate_fn",
                                          "setup_dynamic_batch")}
    assert not getattr(cls, "_zorro_installed", False)
    STOCK_METHODS.update(saved)
    batching.install_replay_buffer(cls)
    try:
        yield cls
    finally:
        for k, v in saved.items():
            setattr(cls, k, v)
        cls._zorro_installed = False


def fill(buffer, samples, per_experience: int):
    """As the experience maker hands micro-batches to the buffer (``Experience.concat_experiences`` of samples)."""
    for i in range(0, len(samples), per_experience):
        buffer.append(Experience.concat_experiences(samples[i: i + per_experience], 0))


def maker(dynamic: bool, n: int, micro: int = 8, max_tokens: int = 40, gpus: int = 2):
    args = SimpleNamespace(
        rollout=SimpleNamespace(n_samples_per_prompt=n, micro_batch_size=micro, max_tokens_per_gpu=max_tokens),
        train=SimpleNamespace(dynamic_batch_enable=dynamic),
        actor=SimpleNamespace(num_nodes=1, num_gpus_per_node=gpus),
        ds=SimpleNamespace(ring_attn_size=1, tensor_parallel_size=1))
    return SimpleNamespace(args=args, tokenizer=SimpleNamespace(pad_token_id=0))


def groups_of_batch(exp):
    return [prompt_of(s[m.bool()], a) for s, m, a in zip(exp.sequences, exp.attention_mask, exp.action_mask)]


def test_experience_maker_dynamic_batches_whole_groups_within_budget():
    samples = rollout_samples(4, prompts=6, seed=2)
    self = maker(dynamic=True, n=4, max_tokens=40, gpus=2)
    out = batching.split_rollout_samples(self, samples)
    assert len(out) % 2 == 0  # a multiple of the actor's DP size
    assert sorted(i for e in out for i in e.index) == list(range(len(samples)))  # advantages find every sample
    owners = {}
    for k, e in enumerate(out):
        g, p, r = batching.sample_groups(e.sequences, e.attention_mask, e.action_mask)
        assert microbatch_cost(range(len(g)), g, p, r) <= 40  # the budget counts each prompt once
        for key in groups_of_batch(e):
            owners.setdefault(key, set()).add(k)
    assert self.zorro_split_groups == sum(1 for v in owners.values() if len(v) > 1) == 0


def test_experience_maker_fixed_batches_warn_when_misaligned(caplog, monkeypatch):
    monkeypatch.setattr(batching, "_WARNED_SIZES", set(), raising=False)
    samples = rollout_samples(3, prompts=4)
    self = maker(dynamic=False, n=3, micro=4)
    with caplog.at_level(logging.WARNING):
        out = batching.split_rollout_samples(self, samples)
        batching.split_rollout_samples(self, samples)
    assert [e.sequences.shape[0] for e in out] == [4, 4, 4]  # OpenRLHF's contiguous chunks, unchanged
    assert sum("not a multiple" in r.getMessage() for r in caplog.records) == 1
    owners = {}
    for k, e in enumerate(out):
        for key in groups_of_batch(e):
            owners.setdefault(key, set()).add(k)
    assert self.zorro_split_groups == 2 * sum(1 for v in owners.values() if len(v) > 1)  # two calls counted
    aligned = maker(dynamic=False, n=3, micro=6)
    batching.split_rollout_samples(aligned, samples)
    assert aligned.zorro_split_groups == 0


def test_dp_balancing_whole_groups_mode_keeps_groups_on_one_rank():
    samples = rollout_samples(4, prompts=6, seed=4)
    experiences = [Experience.concat_experiences(samples[i: i + 8], 0) for i in range(0, len(samples), 8)]
    ranks = batching.make_balance_experiences("whole_groups")(experiences, maker(dynamic=True, n=4, gpus=2).args)
    assert [e.sequences.shape[0] for e in ranks] == [12, 12]
    owners = {}
    for k, e in enumerate(ranks):
        for key in groups_of_batch(e):
            owners.setdefault(key, set()).add(k)
    assert all(len(v) == 1 for v in owners.values()) and len(owners) == 6


@pytest.fixture
def gloo_world(tmp_path):
    """A one-rank gloo group: OpenRLHF's setup_dynamic_batch all-reduces over the DP group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        # a file rendezvous: no TCP port that another process could hold
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def dynamic_strategy(max_tokens: int, n: int, rows: int):
    args = SimpleNamespace(train=SimpleNamespace(batch_size=rows // 2, max_tokens_per_gpu=max_tokens),
                           rollout=SimpleNamespace(batch_size=rows // n, n_samples_per_prompt=n),
                           ds=SimpleNamespace(ring_attn_size=1, tensor_parallel_size=1))
    mesh = {"dp": SimpleNamespace(get_group=lambda: None)}
    return SimpleNamespace(args=args, ds_device_mesh=mesh, all_reduce=lambda t, op="mean": t)


def test_dynamic_training_batches_regrouped_with_stock_normalisers(zorro_buffer, gloo_world, monkeypatch):
    """OpenRLHF's own setup_dynamic_batch, then zorro's regrouping: the same optimizer steps and windows, the same
    per-step loss normalisers, loss scales that still sum to 1 per step, budgets held, groups whole."""
    samples = rollout_samples(4, prompts=6, seed=5)
    strategy = dynamic_strategy(max_tokens=40, n=4, rows=len(samples))
    zorro = zorro_buffer(1, 0, True, True, True)
    stock = zorro_buffer(1, 0, True, True, True)
    zorro.zorro_regroup = True  # the actor's buffer (install_training_batches marks it)
    fill(stock, samples, per_experience=8)
    fill(zorro, samples, per_experience=8)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # OpenRLHF puts its counters on this device
    STOCK_METHODS["setup_dynamic_batch"](stock, strategy)  # OpenRLHF's own partition (dynamic mode: stock methods)
    zorro.setup_dynamic_batch(strategy)

    def steps(buf):
        out, cur = [], []
        for part, scale, tok, size, last in zip(buf.dynamic_indices, buf.dynamic_sample_loss_scale,
                                                buf.dynamic_batch_num_tokens, buf.dynamic_global_batch_size,
                                                buf.dynamic_optimizer_step):
            cur.append((part, scale, tok, size))
            if last:
                out.append(cur)
                cur = []
        return out

    s_steps, z_steps = steps(stock), steps(zorro)
    assert len(s_steps) == len(z_steps) == 2
    g, p, r = batching._items_groups(zorro.items)
    for s_step, z_step in zip(s_steps, z_steps):
        assert sorted(i for part, *_ in s_step for i in part) == sorted(i for part, *_ in z_step for i in part)
        assert {(tok, size) for _, _, tok, size in s_step} == {(tok, size) for _, _, tok, size in z_step}
        assert abs(sum(scale for _, scale, _, _ in z_step) - 1.0) < 1e-12
        for part, *_ in z_step:
            assert microbatch_cost(part, g, p, r) <= 40
    owners = {}
    for k, part in enumerate(zorro.dynamic_indices):
        for i in part:
            owners.setdefault(g[i], set()).add(k)
    assert batching.pop_split_counts()["train"] == sum(1 for v in owners.values() if len(v) > 1)
    stock_owners = {}
    for k, part in enumerate(stock.dynamic_indices):
        for i in part:
            stock_owners.setdefault(g[i], set()).add(k)
    assert sum(len(v) for v in owners.values()) < sum(len(v) for v in stock_owners.values())
    loader = DataLoader(zorro, batch_size=zorro.sample_batch_size, shuffle=False, collate_fn=zorro.collate_fn)
    assert [e.sequences.shape[0] for e in loader] == [len(part) for part in zorro.dynamic_indices]


def test_dynamic_critic_buffer_stays_stock(zorro_buffer, gloo_world, monkeypatch):
    """The critic's replay buffer (same class, not marked by the actor trainer) runs the stock forward: zorro must
    not repack it by deduplicated tokens, which would exceed --train.max_tokens_per_gpu in raw tokens."""
    samples = rollout_samples(4, prompts=6, seed=5)
    strategy = dynamic_strategy(max_tokens=40, n=4, rows=len(samples))
    critic = zorro_buffer(1, 0, True, True, True)
    stock = zorro_buffer(1, 0, True, True, True)
    fill(critic, samples, per_experience=8)
    fill(stock, samples, per_experience=8)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    STOCK_METHODS["setup_dynamic_batch"](stock, strategy)
    critic.setup_dynamic_batch(strategy)
    assert critic.dynamic_indices == stock.dynamic_indices
    raw = [int(it.attention_mask.sum()) for it in critic.items]
    assert max(sum(raw[i] for i in part) for part in critic.dynamic_indices) <= 40


def test_experience_maker_dynamic_budget_in_raw_tokens_with_a_critic():
    """With a critic or a reward model reading the experience maker's micro-batches (the stock forward), the
    budget counts raw tokens: no micro-batch over --rollout.max_tokens_per_gpu; groups still kept together."""
    samples = rollout_samples(4, prompts=6, seed=2)
    budget = 40
    for role in ("critic_model_group", "reward_model_group"):
        self = maker(dynamic=True, n=4, max_tokens=budget, gpus=2)
        setattr(self, role, object())
        out = batching.split_rollout_samples(self, samples)
        assert sorted(i for e in out for i in e.index) == list(range(len(samples)))
        raw = [int(e.attention_mask.sum()) for e in out]
        assert max(raw) <= budget, raw
        owners = {}
        for k, e in enumerate(out):
            for key in groups_of_batch(e):
                owners.setdefault(key, set()).add(k)
        # a group of 4 samples costs over 40 raw tokens here, so it must be cut (counted), into few pieces
        assert self.zorro_split_groups == sum(1 for v in owners.values() if len(v) > 1)
        assert max(len(v) for v in owners.values()) <= 3
    # without a stock reader the same budget counts deduplicated tokens, and some micro-batch exceeds 40 raw tokens
    alone = maker(dynamic=True, n=4, max_tokens=budget, gpus=2)
    out = batching.split_rollout_samples(alone, samples)
    assert max(int(e.attention_mask.sum()) for e in out) > budget


def stock_dynamic_steps(rank_items, args, dp):
    """Which samples each optimizer step trains on, as OpenRLHF's ``setup_dynamic_batch`` cuts every rank's buffer
    (``local_train_batch_size = --train.batch_size // dp`` consecutive samples per step, ``min`` steps over ranks)."""
    L = args.train.batch_size // dp
    expected = args.rollout.batch_size * args.rollout.n_samples_per_prompt // args.train.batch_size
    steps = min([expected] + [len(items) // L for items in rank_items])
    return [sorted(key for items in rank_items for key in items[k * L:(k + 1) * L]) for k in range(steps)]


def item_keys(exp):
    """``(prompt tokens, sample tokens)`` per row."""
    return [(prompt_of(s[m.bool()], a), tuple(s[m.bool()].tolist()))
            for s, m, a in zip(exp.sequences, exp.attention_mask, exp.action_mask)]


@pytest.mark.parametrize("gpus,critic_gpus", [(2, 0), (2, 1), (4, 2)])
def test_dp_balancing_keeps_stock_optimizer_steps(gpus, critic_gpus):
    """Dynamic batching: every optimizer step (actor's and critic's) trains on the samples of stock OpenRLHF's
    run: stock = OpenRLHF's own split_rollout_samples + balance_experiences; zorro = its experience maker's regrouped
    micro-batches + its balancing. Groups share a rank inside each step more often than stock."""
    from openrlhf.trainer.ppo_utils.experience import balance_experiences as stock_balance

    from tests.support.openrlhf_imports import import_ppo_actor

    import_ppo_actor()  # the experience maker's module imports the Ray launcher (import-only stand-ins for vLLM)
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    n, prompts = 4, 12
    samples = rollout_samples(n, prompts=prompts, seed=6)
    self = maker(dynamic=True, n=n, max_tokens=40, gpus=gpus)
    args = self.args
    args.rollout.batch_size = prompts
    args.train.batch_size = 16  # 48 samples: 3 optimizer steps per rollout
    args.critic = SimpleNamespace(model_name_or_path="critic" if critic_gpus else None, num_nodes=1,
                                  num_gpus_per_node=critic_gpus)
    stock_exps = RemoteExperienceMaker.split_rollout_samples(self, samples)  # OpenRLHF's own, sets index
    stock_ranks = stock_balance(stock_exps, args)
    zorro_exps = batching.split_rollout_samples(self, samples)
    zorro_ranks = batching.balance_experiences(zorro_exps, args)  # the default mode's
    assert [len(e.sequences) for e in zorro_ranks] == [len(e.sequences) for e in stock_ranks]
    s_items, z_items = [item_keys(e) for e in stock_ranks], [item_keys(e) for e in zorro_ranks]
    assert stock_dynamic_steps(z_items, args, gpus) == stock_dynamic_steps(s_items, args, gpus)
    assert len(stock_dynamic_steps(s_items, args, gpus)) == 3
    if critic_gpus:  # the critic gets the actor ranks' batches in contiguous chunks over its own ranks
        chunk = -(-gpus // critic_gpus)

        def critic_ranks(items):
            return [[k for r in range(q * chunk, min((q + 1) * chunk, gpus)) for k in items[r]]
                    for q in range(critic_gpus)]

        assert stock_dynamic_steps(critic_ranks(z_items), args, critic_gpus) == \
            stock_dynamic_steps(critic_ranks(s_items), args, critic_gpus)

    def group_pieces(items):
        L = args.train.batch_size // gpus
        out = 0
        for r in range(gpus):
            for s in range(3):
                out += len({k[0] for k in items[r][s * L:(s + 1) * L]})
        return out

    # a critic with another DP size pins positions to its own steps too (with 2 actor ranks and 1 critic rank no
    # position shares both steps with a position of the other rank: nothing may move)
    assert group_pieces(z_items) <= group_pieces(s_items)
    if not critic_gpus:
        assert group_pieces(z_items) < group_pieces(s_items)


@pytest.mark.parametrize("count,dp", [(7, 2), (10, 3), (13, 4), (16, 4)])
def test_stock_rank_order_is_openrlhfs(count, dp):
    """zorro's replica of OpenRLHF's interleaving (ties in length keep their order) against the real function, with
    batch sizes that do not divide by the DP size."""
    from openrlhf.trainer.ppo_utils.experience import balance_experiences as stock_balance

    samples = rollout_samples(1, prompts=count, seed=count)  # lengths 4..15 with many ties
    args = maker(dynamic=True, n=1, gpus=dp).args
    exps = [Experience.concat_experiences(samples[i: i + 3], 0) for i in range(0, count, 3)]
    stock = [item_keys(e) for e in stock_balance(exps, args)]
    keys = [k for e in exps for k in item_keys(e)]
    ranks = batching.stock_rank_order([float(s.total_length) for s in samples], dp)
    assert [[keys[i] for i in rows] for rows in ranks] == stock
