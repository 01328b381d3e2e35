"""``group_balance_mode: keep_minibatches`` (the default) on verl 0.9.1's real trainer methods: every optimizer step
— each mini-batch of each epoch, for the actor and the critic, shuffled or not — holds exactly the global set of
rows a stock run gives it; rows only change DP rank inside a mini-batch, where a group's rows come together.

The oracle is verl's worker itself: ``train_mini_batch`` hands rank ``k`` the ``k``-th equal chunk and iterates
``tensordict_utils.make_iterator(chunk, mini_batch_size / dp, epochs, seed + k, shuffle)``; :func:`_steps` runs that
on the dispatched order. The ``whole_groups`` mode (opt-in) is shown to change the sets.
"""

import random
import types

import pytest
import torch

from tests.support import HANG_TIMEOUT_S
from zorro_verl.integrations.verl.v09.markers import BALANCE_MARKER_KEY

pytestmark = pytest.mark.usefixtures("verl_cpu")

N = 4  # rollout.n


def _steps(order, dp, mini_global, epochs, seed, shuffle):
    """verl's worker mini-batches for a dispatched row order: per optimizer step, the rows of every rank."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    chunk = len(order) // dp
    steps = None
    for k in range(dp):
        mine = torch.tensor(order[k * chunk:(k + 1) * chunk])
        td = TensorDict({"row": mine}, batch_size=[chunk])
        got = [mb["row"].tolist() for mb in tu.make_iterator(td, mini_global // dp, epochs, seed=seed + k,
                                                              dataloader_kwargs={"shuffle": shuffle})]
        steps = [[] for _ in got] if steps is None else steps
        for s, rows in enumerate(got):
            steps[s].append(rows)
    return steps


def _sets(steps):
    return [sorted(r for rank in step for r in rank) for step in steps]


def _group_spread(steps, group):
    """Extra ranks a group's rows occupy inside a mini-batch, summed over steps and groups (0 = all gathered)."""
    total = 0
    for step in steps:
        owners = {}
        for k, rows in enumerate(step):
            for b in rows:
                owners.setdefault(group[b], set()).add(k)
        total += sum(len(s) - 1 for s in owners.values())
    return total


def _config(enable, mode, *, mini, epochs, shuffle, critic_mini=None):
    from omegaconf import OmegaConf

    cfg = {"trainer": {"critic_warmup": 0, "balance_batch": True},
           "actor_rollout_ref": {"rollout": {"n": N}, "actor": {
               "ppo_mini_batch_size": mini, "ppo_epochs": epochs, "shuffle": shuffle, "data_loader_seed": 7,
               "fsdp_config": {"zorro": {"enable": enable, "rollout_n": N, "group_balance_mode": mode}}}}}
    if critic_mini:
        cfg["critic"] = {"ppo_mini_batch_size": critic_mini, "ppo_epochs": 1, "shuffle": True, "data_loader_seed": 3}
    return OmegaConf.create(cfg)


def _long_tailed_lengths(n_rows, seed):
    rng = random.Random(seed)
    return [min(60, max(1, int(rng.lognormvariate(2.3, 0.8)))) for _ in range(n_rows)]


# ----------------------------------------------------------------------------------------- V1 (KVBatchMeta)
def _v1_run(enable, mode, keys, plens, rlens, *, dp, mini, epochs, shuffle, critic_mini=None, critic_dp=None):
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    tags = [{"status": "success", "prompt_len": p, "response_len": r, "seq_len": p + r} for p, r in zip(plens, rlens)]
    batch = KVBatchMeta(partition_id="train", keys=list(keys), tags=tags)
    me = types.SimpleNamespace(config=_config(enable, mode, mini=mini, epochs=epochs, shuffle=shuffle,
                                              critic_mini=critic_mini),
                               use_critic=bool(critic_mini), global_steps=1,
                               actor_rollout_wg=types.SimpleNamespace(_dispatch_info={"actor": list(range(dp))}),
                               # the critic's worker group as verl 0.9.1 builds it: a TrainingWorker group, whose
                               # dispatch info is registered under the TrainingWorker's own mesh (no "critic" one)
                               critic_wg=types.SimpleNamespace(_dispatch_info={
                                   _training_worker_mesh(): list(range(critic_dp or dp))}),
                               tokenizer=types.SimpleNamespace(eos_token_id=0))
    me._get_required_batch_multiple = types.MethodType(PPOTrainer._get_required_batch_multiple, me)
    metrics = {}
    out = PPOTrainer._balance_batch(me, batch, metrics)
    assert out.extra_info[BALANCE_MARKER_KEY]  # the stamp the engine checks, zorro on or off
    index = {k: i for i, k in enumerate(keys)}
    return [index[k] for k in out.keys], metrics


def _training_worker_mesh() -> str:
    """The mesh name verl's ``TrainingWorker`` (the critic's worker in verl 0.9.1) registers its dispatch info under,
    read from its ``__init__``."""
    import inspect
    import re

    from verl.workers.engine_workers import TrainingWorker

    names = set(re.findall(r'_register_dispatch_collect_info\(\s*mesh_name="(\w+)"',
                           inspect.getsource(TrainingWorker.__init__)))
    assert len(names) == 1, names
    return names.pop()


def test_critic_mesh_is_the_training_workers():
    """zorro queries the critic's DP size under the mesh the trainer dispatches its update on (``train_mini_batch``'s
    registration), which is the one verl's critic worker registers."""
    from zorro_verl.integrations.verl.v09.balance import critic_mesh_name

    assert critic_mesh_name() == _training_worker_mesh() == "train"


def _v1_batch(n_prompts, seed):
    """``n_prompts`` x N rollouts, siblings adjacent as verl's rollout stores them, long-tailed response lengths."""
    rng = random.Random(seed)
    keys, plens = [], []
    for u in range(n_prompts):
        pl = rng.randint(8, 40)
        for s in range(N):
            keys.append(f"u{u}_{s}_0")
            plens.append(pl)
    return keys, plens, _long_tailed_lengths(len(keys), seed)


CASES = [  # dp, ppo_mini_batch_size (prompts), ppo_epochs, shuffle, critic mini-batch (prompts) and DP
    pytest.param(2, 2, 1, False, None, None, id="dp2-4mb"),
    pytest.param(2, 2, 2, False, None, None, id="dp2-4mb-2epochs"),
    pytest.param(4, 4, 2, True, None, None, id="dp4-2mb-2epochs-shuffle"),
    pytest.param(2, 2, 1, False, 4, 2, id="dp2-4mb-critic2mb-shuffled"),
    pytest.param(2, 4, 1, False, 2, 4, id="dp2-critic-dp4"),
    pytest.param(1, 2, 2, True, None, None, id="dp1-shuffle"),
]


@pytest.mark.parametrize("dp,mini,epochs,shuffle,critic_mini,critic_dp", CASES)
def test_v1_default_keeps_every_optimizer_step_of_stock(dp, mini, epochs, shuffle, critic_mini, critic_dp):
    keys, plens, rlens = _v1_batch(8, seed=dp * 10 + mini)
    kw = dict(dp=dp, mini=mini, epochs=epochs, shuffle=shuffle, critic_mini=critic_mini, critic_dp=critic_dp)
    stock, _ = _v1_run(False, "keep_minibatches", keys, plens, rlens, **kw)
    zorro, metrics = _v1_run(True, "keep_minibatches", keys, plens, rlens, **kw)
    assert sorted(zorro) == list(range(len(keys)))
    s_steps = _steps(stock, dp, mini * N, epochs, 7, shuffle)
    z_steps = _steps(zorro, dp, mini * N, epochs, 7, shuffle)
    assert len(s_steps) == len(z_steps) == epochs * 8 // mini
    assert _sets(z_steps) == _sets(s_steps)  # the actor's optimizer steps are stock's, row for row
    if critic_mini:
        cdp = critic_dp or dp
        assert _sets(_steps(zorro, cdp, critic_mini * N, 1, 3, True)) == \
            _sets(_steps(stock, cdp, critic_mini * N, 1, 3, True))
    group = [k.split("_")[0] for k in keys]
    assert _group_spread(z_steps, group) <= _group_spread(s_steps, group)
    if dp > 1 and not shuffle and not critic_mini:
        assert _group_spread(z_steps, group) < _group_spread(s_steps, group)  # and groups did come together
    assert metrics.get("zorro/balance_fallbacks", 0) == 0
    assert metrics["zorro/balance_minibatch_slots"] >= len(s_steps) // epochs


def test_v1_whole_groups_mode_changes_minibatches_and_says_so(caplog):
    """The issue's synthetic batch (8 prompts x 4, dp 2, 4 mini-batches): the opt-in whole-group mode gathers
    every group in one (rank, mini-batch) slot, which changes every mini-batch's rows; it is logged."""
    keys, plens, rlens = _v1_batch(8, seed=1)
    kw = dict(dp=2, mini=2, epochs=1, shuffle=False)
    stock, _ = _v1_run(False, "keep_minibatches", keys, plens, rlens, **kw)
    with caplog.at_level("WARNING"):
        whole, metrics = _v1_run(True, "whole_groups", keys, plens, rlens, **kw)
    s_steps, w_steps = _steps(stock, 2, 2 * N, 1, 7, False), _steps(whole, 2, 2 * N, 1, 7, False)
    assert sum(a != b for a, b in zip(_sets(s_steps), _sets(w_steps))) >= 3
    assert _group_spread(w_steps, [k.split("_")[0] for k in keys]) == 0
    assert metrics["zorro/balance_minibatch_split_groups"] == 0
    assert "group_balance_mode=whole_groups" in caplog.text


# ------------------------------------------------------------------------------------------- V0 (DataProto)
def _v0_batch(n_prompts, seed):
    from zorro_verl.testing import create_dummy_batch

    b = create_dummy_batch(batch_size=n_prompts * N, num_unique_prompts=n_prompts, prompt_len=8, response_len=12,
                           device="cpu", add_padding=True, seed=seed, shuffle=False)
    b["prompts"] = b["input_ids"][:, :8]
    b["responses"] = b["input_ids"][:, 8:]
    return b


@pytest.mark.parametrize("shuffle,epochs", [(False, 2), (True, 1)])
def test_v0_default_keeps_every_optimizer_step_of_stock(shuffle, epochs):
    rt = pytest.importorskip("verl.trainer.ppo.ray_trainer", exc_type=ImportError)
    from verl import DataProto

    from zorro_verl.integrations.verl.v09.balance import install_v0_hook

    install_v0_hook(rt)
    raw = _v0_batch(8, seed=3)
    B, dp, mini = 32, 2, 2
    orders = {}
    for enable in (False, True):
        batch = DataProto.from_dict({**raw, "row": torch.arange(B)})
        me = types.SimpleNamespace(config=_config(enable, "keep_minibatches", mini=mini, epochs=epochs,
                                                  shuffle=shuffle),
                                   use_critic=False, global_steps=1,
                                   actor_rollout_wg=types.SimpleNamespace(_dispatch_info={"actor": [0, 1]}))
        me._get_dp_size = types.MethodType(rt.RayPPOTrainer._get_dp_size, me)
        metrics = {}
        rt.RayPPOTrainer._balance_batch(me, batch, metrics)
        assert batch.meta_info[BALANCE_MARKER_KEY]
        orders[enable] = batch.batch["row"].tolist()
        assert metrics.get("zorro/balance_fallbacks", 0) == 0
    s_steps = _steps(orders[False], dp, mini * N, epochs, 7, shuffle)
    z_steps = _steps(orders[True], dp, mini * N, epochs, 7, shuffle)
    assert _sets(z_steps) == _sets(s_steps)
    assert orders[True] != orders[False]  # zorro did move rows (inside mini-batches)
    key = [tuple(raw["prompts"][i][raw["attention_mask"][i, :8].bool()].tolist()) for i in range(B)]
    assert _group_spread(z_steps, key) <= _group_spread(s_steps, key)


def test_keep_minibatches_error_keeps_verl_placement(monkeypatch, caplog):
    """An error inside the regrouping leaves verl's own placement (the run stays stock's), warned and counted."""
    from zorro_verl.integrations.verl.v09 import balance

    def boom(*a, **k):
        raise RuntimeError("injected")

    monkeypatch.setattr(balance, "regroup_within_slots", boom)
    keys, plens, rlens = _v1_batch(4, seed=5)
    kw = dict(dp=2, mini=2, epochs=1, shuffle=False)
    stock, _ = _v1_run(False, "keep_minibatches", keys, plens, rlens, **kw)
    with caplog.at_level("WARNING"):
        zorro, metrics = _v1_run(True, "keep_minibatches", keys, plens, rlens, **kw)
    assert zorro == stock
    assert metrics["zorro/balance_fallbacks"] == 1
    assert "verl's placement is kept" in caplog.text


def test_balance_dedup_script_reports_each_placement():
    """``scripts/balance_dedup.py`` (the docs' table) on a smaller batch: verl's placement and keep_minibatches keep
    verl's optimizer steps, whole_groups does not; deduplication keep >= verl and whole >= keep."""
    import subprocess
    import sys

    from tests.support import REPO_ROOT

    out = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "balance_dedup.py"), "--prompts", "64",
                          "--n", "8", "--mini", "16", "--dp", "4"], capture_output=True, text=True,
                         timeout=HANG_TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {}
    for line in out.stdout.splitlines():
        parts = line.split()
        if parts and parts[0] in ("verl", "keep_minibatches", "whole_groups"):
            rows[parts[0]] = (float(parts[1]), float(parts[2]), float(parts[3]), parts[4])
    assert set(rows) == {"verl", "keep_minibatches", "whole_groups"}, out.stdout
    assert rows["verl"][3] == "yes" and rows["keep_minibatches"][3] == "yes" and rows["whole_groups"][3] == "no"
    assert rows["keep_minibatches"][0] > rows["verl"][0] and rows["whole_groups"][0] >= rows["keep_minibatches"][0]
    assert rows["keep_minibatches"][1] >= rows["verl"][1]
