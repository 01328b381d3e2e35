"""Group-aware batching on OpenRLHF's real replay buffer, Experience collation and experience-maker inputs.

The buffer is OpenRLHF's ``NaiveReplayBuffer`` with zorro's methods installed, fed ``Experience`` batches as the
experience maker produces them and read through the same ``DataLoader`` call as ``ActorPPOTrainer.ppo_train``
(``batch_size=buffer.sample_batch_size, shuffle=True, drop_last=True, collate_fn=buffer.collate_fn``).
The buffer's constructor asks ``torch.cuda.current_device()`` for its target device; on CPU the tests answer 0.
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
    STOCK_METHODS.update(saved)
    batching.install_replay_buffer(cls)
    try:
        yield cls
    finally:
        for k, v in saved.items():
            setattr(cls, k, v)
        del cls._zorro_installed


def fill(buffer, samples, per_experience: int):
    """As the experience maker hands micro-batches to the buffer (``Experience.concat_experiences`` of samples)."""
    for i in range(0, len(samples), per_experience):
        buffer.append(Experience.concat_experiences(samples[i: i + per_experience], 0))


@pytest.mark.parametrize("n,micro", [(4, 8), (2, 4), (4, 4), (3, 4), (8, 4)])
def test_training_micro_batches_keep_groups_whole(zorro_buffer, n, micro):
    samples = rollout_samples(n, prompts=6)
    buffer = zorro_buffer(micro, 0, True, False, False)
    fill(buffer, samples, per_experience=n * 2)
    loader = DataLoader(buffer, batch_size=buffer.sample_batch_size, shuffle=True, drop_last=True,
                        collate_fn=buffer.collate_fn)
    B = len(samples)
    assert len(loader) == B // micro  # the stock count: gradient-accumulation windows unchanged
    seen = []
    for exp in loader:
        assert isinstance(exp, Experience) and exp.sequences.shape[0] == micro  # exactly micro rows, as stock
        keys = [prompt_of(s[m.bool()], a) for s, m, a in zip(exp.sequences, exp.attention_mask, exp.action_mask)]
        seen.append(keys)
    sizes = {}
    for keys in seen:
        for k in set(keys):
            sizes.setdefault(k, []).append(keys.count(k))
    split = sum(1 for v in sizes.values() if len(v) > 1)
    if micro % n == 0:
        assert split == 0, sizes  # whole groups
    else:  # sizes that do not tile: counted, and as few cuts as the sizes allow
        assert split == buffer.zorro_split_groups > 0
        if n > micro:  # every group in the fewest micro-batches it can occupy
            assert all(len(v) == -(-n // micro) for v in sizes.values()), sizes
        else:  # each micro-batch holds at least one whole group
            assert sum(len(v) == 1 for v in sizes.values()) >= len(seen), sizes
    assert sum(len(k) for k in seen) == (B // micro) * micro


def test_stock_buffer_mixes_groups(monkeypatch):
    """The reason for the above: OpenRLHF's own buffer + DataLoader shuffles single samples."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    torch.manual_seed(0)
    samples = rollout_samples(4, prompts=6)
    buffer = rb_module.NaiveReplayBuffer(8, 0, True, False, False)
    fill(buffer, samples, per_experience=8)
    loader = DataLoader(buffer, batch_size=buffer.sample_batch_size, shuffle=True, drop_last=True,
                        collate_fn=buffer.collate_fn)
    groups_per_mb = [len({prompt_of(s[m.bool()], a) for s, m, a in
                          zip(e.sequences, e.attention_mask, e.action_mask)}) for e in loader]
    assert max(groups_per_mb) > 2  # 8 rows of n = 4 would be 2 groups when kept whole


def test_group_order_is_random_per_buffer(zorro_buffer):
    samples = rollout_samples(2, prompts=6)
    comps = set()
    for seed in range(4):
        torch.manual_seed(seed)
        buffer = zorro_buffer(4, 0, True, False, False)
        fill(buffer, samples, per_experience=4)
        comps.add(tuple(tuple(b) for b in sorted(batching._buffer_batches(buffer).batches)))
    assert len(comps) > 1  # which groups share a micro-batch is drawn, not fixed


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


def test_experience_maker_fixed_batches_warn_when_misaligned(caplog):
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


def test_dp_balancing_keeps_groups_on_one_rank():
    samples = rollout_samples(4, prompts=6, seed=4)
    experiences = [Experience.concat_experiences(samples[i: i + 8], 0) for i in range(0, len(samples), 8)]
    ranks = batching.balance_experiences(experiences, maker(dynamic=True, n=4, gpus=2).args)
    assert [e.sequences.shape[0] for e in ranks] == [12, 12]
    owners = {}
    for k, e in enumerate(ranks):
        for key in groups_of_batch(e):
            owners.setdefault(key, set()).add(k)
    assert all(len(v) == 1 for v in owners.values()) and len(owners) == 6


@pytest.fixture
def gloo_world():
    """A one-rank gloo group: OpenRLHF's setup_dynamic_batch all-reduces over the DP group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
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
    assert zorro.zorro_split_groups == sum(1 for v in owners.values() if len(v) > 1)
    stock_owners = {}
    for k, part in enumerate(stock.dynamic_indices):
        for i in part:
            stock_owners.setdefault(g[i], set()).add(k)
    assert sum(len(v) for v in owners.values()) < sum(len(v) for v in stock_owners.values())
    loader = DataLoader(zorro, batch_size=zorro.sample_batch_size, shuffle=False, collate_fn=zorro.collate_fn)
    assert [e.sequences.shape[0] for e in loader] == [len(part) for part in zorro.dynamic_indices]


@pytest.mark.parametrize("gas", [1, 2, 6])
def test_loss_normalisers_unchanged(zorro_buffer, gas):
    """OpenRLHF's own ``iter_grad_accum_global_norm`` over the group micro-batches: the same number of optimizer
    windows of ``gas`` micro-batches of the same size as the stock DataLoader, and over all windows the same action
    tokens and samples (a window's normaliser is its own token-mean denominator, as in stock)."""
    from openrlhf.utils.loss_utils import iter_grad_accum_global_norm

    samples = rollout_samples(4, prompts=6, seed=7)
    strategy = SimpleNamespace()
    totals = []
    for grouped in (False, True):
        if grouped:
            buffer = zorro_buffer(4, 0, True, False, False)
        else:
            buffer = zorro_buffer.__new__(zorro_buffer)
            STOCK_METHODS["__init__"](buffer, 4, 0, True, False, False)  # OpenRLHF's own buffer
        fill(buffer, samples, per_experience=8)
        loader = DataLoader(buffer, batch_size=buffer.sample_batch_size, shuffle=True, drop_last=True,
                            collate_fn=buffer.collate_fn)
        infos = [info for _, info in iter_grad_accum_global_norm(loader, strategy, gas, lambda e: e.action_mask)]
        windows = infos[::gas]
        totals.append((len(infos), len(windows), sum(float(w["batch_num_tokens"]) for w in windows) * gas,
                       sum(float(w["global_batch_size"]) for w in windows) * gas))
    # counts exact; token / sample sums are integers divided by gas in fp32 by OpenRLHF, then multiplied back here
    assert totals[0][:2] == totals[1][:2] and totals[0][2:] == pytest.approx(totals[1][2:], rel=1e-6), totals
    assert totals[1][2] == pytest.approx(sum(float(s.action_mask.sum()) for s in samples), rel=1e-6)
