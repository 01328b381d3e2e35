"""Group-aware DP balancing hooked into verl's trainers: whole groups per rank, equal rows per rank, switchable."""

import types

import pytest
import torch

from tests.support import HANG_TIMEOUT_S

pytestmark = pytest.mark.usefixtures("verl_cpu")


def _batch(B=16, G=4, seed=0):
    from zorro_verl.testing import create_dummy_batch

    b = create_dummy_batch(batch_size=B, num_unique_prompts=G, prompt_len=6, response_len=4, device="cpu",
                           add_padding=True, seed=seed, shuffle=True)
    b["prompts"] = b["input_ids"][:, :6]
    return b


def _owner_ranks(groups, chunks):
    owners = {}
    for k, rows in enumerate(chunks):
        for g in rows:
            owners.setdefault(g, set()).add(k)
    return owners


def test_group_balance_keeps_groups_whole():
    from zorro_verl.integrations.verl.v09.balance import group_balance

    b = _batch()
    bal = group_balance(b["prompts"], b["attention_mask"], 2)
    assert [len(r) for r in bal.ranks] == [8, 8] and bal.split_groups == 0
    key = [tuple(b["prompts"][i][b["attention_mask"][i, :6].bool()].tolist()) for i in range(16)]
    owners = _owner_ranks(None, [[key[i] for i in rows] for rows in bal.ranks])
    assert len(owners) == 4 and all(len(s) == 1 for s in owners.values())


def _trainer_self(enable, group_balance=True, dp=4, mode="whole_groups", mini=4, n=1, epochs=1, shuffle=False):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"trainer": {"critic_warmup": 0}, "actor_rollout_ref": {
        "rollout": {"n": n},
        "actor": {"ppo_mini_batch_size": mini, "ppo_epochs": epochs, "shuffle": shuffle, "data_loader_seed": 42,
                  "fsdp_config": {"zorro": {"enable": enable, "group_balance": group_balance,
                                            "group_balance_mode": mode}}}}})
    wg = types.SimpleNamespace(_dispatch_info={"actor": list(range(dp))})
    return types.SimpleNamespace(config=cfg, actor_rollout_wg=wg, use_critic=False, global_steps=1,
                                 _get_dp_size=lambda wg, role: dp)


def test_v0_trainer_hook_real_ray_trainer():
    rt = pytest.importorskip("verl.trainer.ppo.ray_trainer", exc_type=ImportError)
    from verl import DataProto

    from zorro_verl.integrations.verl.v09.balance import install_v0_hook

    install_v0_hook(rt)  # idempotent; the plugin's post-import hook normally did it already
    assert rt.RayPPOTrainer._balance_batch._zorro_hook
    raw = _batch(B=16, G=4, seed=1)
    tag = torch.arange(16)
    for enable, expect_whole in ((True, True), (False, None)):
        batch = DataProto.from_dict({**raw, "row": tag.clone()})
        metrics = {}
        rt.RayPPOTrainer._balance_batch(_trainer_self(enable), batch, metrics)
        rows = batch.batch["row"]
        assert sorted(rows.tolist()) == list(range(16))
        chunks = [rows[i * 4:(i + 1) * 4].tolist() for i in range(4)]  # verl dispatches equal DP chunks
        key = [tuple(raw["prompts"][i][raw["attention_mask"][i, :6].bool()].tolist()) for i in range(16)]
        owners = _owner_ranks(None, [[key[i] for i in c] for c in chunks])
        assert any(k.startswith("global_seqlen") for k in metrics)
        if expect_whole:
            assert all(len(s) == 1 for s in owners.values()) and metrics["zorro/balance_split_groups"] == 0
        else:  # zorro off: verl's own balancing ran, no zorro metrics
            assert not any(k.startswith("zorro/") for k in metrics)


def test_v1_trainer_hook_logic():
    """The hook on a stand-in module that has the two names it uses, with KVBatchMeta-like keys
    ``{uid}_{session}_{i}`` and verl's tags (the real V1 trainer is tested below)."""
    from zorro_verl.integrations.verl.v09.balance import install_v1_hook, v1_group_of_key

    class Batch:
        def __init__(self, keys, tags):
            self.keys, self.tags = list(keys), list(tags)
            self.extra_info = {}

        def __len__(self):
            return len(self.keys)

        def reorder(self, idx):
            self.keys = [self.keys[i] for i in idx]
            self.tags = [self.tags[i] for i in idx]

    class PPOTrainer:
        def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
            metrics["stock"] = True
            return batch

    mod = types.SimpleNamespace(PPOTrainer=PPOTrainer, upsample_batch_to_divisible_size=lambda b, m, e: b)
    install_v1_hook(mod)
    uids = ["a", "b", "c", "d", "a", "b", "c", "d", "a", "b", "c", "d"]  # interleaved siblings, groups of 3
    keys = [f"{u}_s0_{i}" for i, u in enumerate(uids)]
    tags = [{"prompt_len": 10 + ord(u) % 5, "response_len": 3, "seq_len": 13 + ord(u) % 5} for u in uids]
    wg = types.SimpleNamespace(_dispatch_info={"actor": [0, 1]})
    me = types.SimpleNamespace(config=_trainer_self(True).config, actor_rollout_wg=wg, use_critic=False,
                               _get_required_batch_multiple=lambda dp: dp,
                               tokenizer=types.SimpleNamespace(eos_token_id=0))
    metrics = {}
    out = PPOTrainer._balance_batch(me, Batch(keys, tags), metrics)
    halves = [out.keys[:6], out.keys[6:]]
    owners = _owner_ranks(None, [[v1_group_of_key(k) for k in h] for h in halves])
    assert all(len(s) == 1 for s in owners.values()) and metrics["zorro/balance_split_groups"] == 0
    off = {}
    me.config = _trainer_self(False).config
    PPOTrainer._balance_batch(me, Batch(keys, tags), off)
    assert off == {"stock": True}


# ------------------------------------------------------------------------------ the real V1 trainer (verl 0.9.1)
def _v1_trainer(dp=2, mini=1, n=4, shuffle=False, rollout_n=4, enable=True, mode="whole_groups", epochs=1):
    """verl's V1 ``PPOTrainer`` methods on a stand-in ``self``: a worker group with ``dp`` actor ranks, the config
    keys ``_balance_batch`` / ``_get_required_batch_multiple`` read."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    cfg = OmegaConf.create({
        "trainer": {"critic_warmup": 0},
        "actor_rollout_ref": {"rollout": {"n": n}, "actor": {
            "ppo_mini_batch_size": mini, "shuffle": shuffle, "ppo_epochs": epochs, "data_loader_seed": 42,
            "fsdp_config": {"zorro": {"enable": enable, "group_balance": True, "rollout_n": rollout_n,
                                      "group_balance_mode": mode}}}}})
    me = types.SimpleNamespace(config=cfg, use_critic=False, global_steps=1,
                               actor_rollout_wg=types.SimpleNamespace(_dispatch_info={"actor": list(range(dp))}),
                               tokenizer=types.SimpleNamespace(eos_token_id=0))
    me._get_required_batch_multiple = types.MethodType(PPOTrainer._get_required_batch_multiple, me)
    return PPOTrainer, me


def _kv(keys, prompt_lens, response_len=3):
    from transfer_queue import KVBatchMeta

    tags = [{"status": "success", "prompt_len": p, "response_len": response_len, "seq_len": p + response_len}
            for p in prompt_lens]
    return KVBatchMeta(partition_id="train", keys=list(keys), tags=tags)


def test_v1_real_trainer_multi_turn_outputs_under_one_uid():
    """An agent loop stores the turns of one trajectory under one uid (``{uid}_{session}_{i}``), turn i > 0 with
    the accumulated conversation as its prompt: balancing groups on (uid, prompt length) and never raises."""
    PPOTrainer, me = _v1_trainer(dp=2, mini=2, n=2, rollout_n=2)
    keys, plens = [], []
    for u, base in (("a", 10), ("b", 12), ("c", 7), ("d", 9)):
        for s in range(2):
            keys += [f"{u}_{s}_0", f"{u}_{s}_1"]
            plens += [base, base + 20 + 5 * s]  # turn 1: a longer, session-specific prompt
    metrics = {}
    out = PPOTrainer._balance_batch(me, _kv(keys, plens), metrics)
    assert sorted(out.keys) == sorted(keys)
    assert metrics["zorro/balance_partial_groups"] == 0  # two sessions per uid = rollout_n
    assert "zorro/balance_fallbacks" not in metrics
    for half in (out.keys[:8], out.keys[8:]):  # the first turns of a uid stay on one rank
        firsts = [k.rsplit("_", 2)[0] for k in half if k.endswith("_0")]
        assert all(firsts.count(u) in (0, 2) for u in "abcd")


def test_v1_real_trainer_whole_groups_fill_minibatches(caplog):
    """Groups of 3 and 1 rollouts (filtered samples), mini-batches of 4 rows: the slots hold whole groups, where
    rank-level ordering would put two 3-groups back to back across a mini-batch boundary."""
    PPOTrainer, me = _v1_trainer(dp=1, mini=1, n=4, rollout_n=4)
    keys = ["a_0_0", "c_0_0", "a_1_0", "c_1_0", "a_2_0", "c_2_0", "b_0_0", "d_0_0"]
    plens = [20, 18, 20, 18, 20, 18, 5, 6]
    metrics = {}
    with caplog.at_level("WARNING"):
        out = PPOTrainer._balance_batch(me, _kv(keys, plens), metrics)
    for mb in (out.keys[:4], out.keys[4:]):
        uids = {k.split("_")[0] for k in mb}
        assert len(uids) == 2 and any(len([k for k in mb if k.startswith(u)]) == 3 for u in uids), out.keys
    assert metrics["zorro/balance_minibatch_split_groups"] == 0
    assert metrics["zorro/balance_partial_groups"] == 4
    assert "zorro.rollout_n=4" in caplog.text


def test_v1_real_trainer_shuffle_warns_and_counts(caplog):
    PPOTrainer, me = _v1_trainer(dp=2, mini=1, n=2, rollout_n=2, shuffle=True)
    keys = [f"{u}_{s}_0" for u in "abcd" for s in range(2)]
    metrics = {}
    with caplog.at_level("WARNING"):
        PPOTrainer._balance_batch(me, _kv(keys, [5, 5, 6, 6, 7, 7, 8, 8]), metrics)
    assert metrics["zorro/balance_shuffled"] == 1 and metrics["zorro/balance_split_groups"] == 0


def test_v1_real_trainer_partial_ranks_warn_and_count(caplog):
    """One prompt of 8 rollouts over 2 ranks of 4 rows: every row of both ranks is in a split group."""
    PPOTrainer, me = _v1_trainer(dp=2, mini=1, n=8, rollout_n=8)
    metrics = {}
    with caplog.at_level("WARNING"):
        PPOTrainer._balance_batch(me, _kv([f"a_{s}_0" for s in range(8)], [9] * 8), metrics)
    assert metrics["zorro/balance_partial_ranks"] == 2 and metrics["zorro/balance_split_groups"] == 1
    assert "most rows belong to prompt groups split across ranks" in caplog.text


def test_v1_real_trainer_balancing_error_falls_back_loudly(monkeypatch, caplog):
    """An error inside zorro's balancing never stops the step: verl's balancing runs, warned and counted."""
    from zorro_verl.integrations.verl.v09 import balance

    def boom(*a, **k):
        raise RuntimeError("injected")

    monkeypatch.setattr(balance, "balance_groups_across_ranks", boom)
    PPOTrainer, me = _v1_trainer(dp=2, mini=1, n=2, rollout_n=2)
    keys = [f"{u}_{s}_0" for u in "abcd" for s in range(2)]
    metrics = {}
    with caplog.at_level("WARNING"):
        out = PPOTrainer._balance_batch(me, _kv(keys, [5] * 8), metrics)
    assert sorted(out.keys) == sorted(keys)
    assert metrics["zorro/balance_fallbacks"] == 1 and any(k.startswith("global_seqlen") for k in metrics)
    assert "group-aware balancing failed" in caplog.text


def test_hook_installation_is_logged(caplog):
    from zorro_verl.integrations.verl.v09.balance import _wrap_balance_batch

    cls = type("SomeTrainer", (), {"_balance_batch": lambda self, batch, metrics, **kw: batch})
    with caplog.at_level("WARNING"):
        _wrap_balance_batch(cls, lambda *a: None, lambda *a: None)
    assert "zorro: group-aware DP balancing installed in" in caplog.text and "SomeTrainer" in caplog.text


def _fresh_python(code: str, **env):
    import os
    import subprocess
    import sys

    from tests.support.verl_cpu_platform import worker_env

    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **worker_env(), **env),
                          capture_output=True, text=True, timeout=HANG_TIMEOUT_S)


def test_preset_installs_hooks_when_verl_plugins_are_restricted():
    """With ``VERL_USE_EXTERNAL_PLUGINS=none`` verl loads no entry point; the preset's ``model.external_lib`` (which
    verl imports wherever it builds the model config, the trainer process included) installs the hooks, and a
    zorro-enabled engine config builds."""
    from tests.support import REPO_ROOT

    code = ("import verl, sys\n"
            "from zorro_verl.integrations.verl.v09 import registration\n"
            "assert not registration.is_installed()\n"
            "from hydra import compose, initialize_config_dir\n"
            f"with initialize_config_dir(config_dir={str(REPO_ROOT / 'configs')!r}, version_base=None):\n"
            "    cfg = compose(config_name='zorro_ppo_trainer')\n"
            "from verl.utils.import_utils import import_external_libs\n"
            "import_external_libs(cfg.actor_rollout_ref.model.external_lib)\n"
            "import verl.trainer.ppo.v1.trainer_base as tb\n"
            "assert tb.PPOTrainer._balance_batch._zorro_hook\n"
            "assert tb.PPOTrainer._compute_ref_log_prob._zorro_metrics_hook\n"
            "print('ok')\n")
    out = _fresh_python(code, VERL_USE_EXTERNAL_PLUGINS="none")
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
    code = ("import verl\n"
            "from zorro_verl.integrations.verl.v09.config import ZorroFSDPEngineConfig\n"
            "ZorroFSDPEngineConfig(zorro={'enable': True})\n"
            "print('ok')\n")
    out = _fresh_python(code, VERL_USE_EXTERNAL_PLUGINS="none")
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
    assert "installing zorro's hooks from the zorro engine config" in out.stderr


# ------------------------------------------------------------------------------- metrics of the log-prob passes
def test_v1_real_trainer_routes_ref_pass_metrics_and_effective_mfu(monkeypatch):
    """verl's V1 ``_compute_ref_log_prob`` drops what ``compute_ref_log_prob`` returns; the zorro metrics of that
    pass reach the step's metrics as ``zorro/ref/*``, with verl's MFU scaled to the computed tokens."""
    import verl.trainer.ppo.v1.trainer_base as tb
    from omegaconf import OmegaConf
    from tensordict import TensorDict
    from transfer_queue import KVBatchMeta

    stored = {}
    fake_tq = types.SimpleNamespace(
        kv_batch_get=lambda keys, partition_id, select_fields: TensorDict(
            {"log_probs": torch.zeros(len(keys), 3), "response_mask": torch.ones(len(keys), 3)},
            batch_size=[len(keys)]),
        kv_batch_put=lambda keys, partition_id, fields: stored.update(fields=fields))
    monkeypatch.setattr(tb, "tq", fake_tq)
    monkeypatch.setattr(tb, "response_from_nested", lambda x, mask: x)
    worker_metrics = {"zorro/dedup_ratio": [2.0, 4.0], "zorro/computed_tokens": [100.0, 100.0],
                      "zorro/prompt_tokens_saved": [100.0, 300.0], "mfu": 0.3, "loss": 0.0}

    def compute_ref_log_prob(batch):
        return KVBatchMeta(partition_id="train", keys=batch.keys, tags=batch.tags,
                           extra_info={"metrics": worker_metrics})

    me = types.SimpleNamespace(
        config=OmegaConf.create({"actor_rollout_ref": {"rollout": {"temperature": 1.0}}}), ref_in_actor=False,
        ref_policy_wg=types.SimpleNamespace(compute_ref_log_prob=compute_ref_log_prob))
    batch = _kv(["a_0_0", "a_1_0"], [4, 4])
    metrics = {}
    tb.PPOTrainer._compute_ref_log_prob(me, batch, metrics)
    assert metrics["zorro/ref/dedup_ratio"] == pytest.approx(3.0)
    assert metrics["zorro/ref/computed_tokens"] == pytest.approx(100.0)
    assert metrics["zorro/effective_mfu/ref"] == pytest.approx(0.3 * 100 / 300)
    assert me.ref_policy_wg.compute_ref_log_prob is compute_ref_log_prob  # the capture is undone
    assert "ref_log_prob" in stored["fields"].keys()


def test_v1_real_trainer_actor_update_effective_mfu():
    import verl.trainer.ppo.v1.trainer_base as tb
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"actor_rollout_ref": {
        "rollout": {"n": 2, "temperature": 1.0},
        "actor": {"ppo_mini_batch_size": 1, "calculate_entropy": False, "entropy_coeff": 0.0, "ppo_epochs": 1,
                  "data_loader_seed": 0, "shuffle": False}}})
    out = {"metrics": {"mfu": [0.4], "zorro/computed_tokens": [50.0], "zorro/prompt_tokens_saved": [150.0],
                       "loss": [1.0]}}
    me = types.SimpleNamespace(config=cfg, actor_rollout_wg=types.SimpleNamespace(update_actor=lambda b: out))
    metrics = {}
    batch = _kv(["a_0_0", "a_1_0"], [4, 4])
    tb.PPOTrainer._update_actor(me, batch, metrics)
    # verl replaces extra_info at every worker call: the wrapper stamps the batch again for the engine
    from zorro_verl.integrations.verl.v09.markers import BALANCE_MARKER_KEY

    assert batch.extra_info[BALANCE_MARKER_KEY]
    assert metrics["perf/mfu/actor"] == pytest.approx(0.4)
    assert metrics["zorro/effective_mfu/actor"] == pytest.approx(0.4 * 50 / 200)


def test_v1_real_trainer_critic_passes_stamp_and_route_metrics(monkeypatch):
    """The critic's passes of verl's V1 trainer: ``_compute_values`` (its worker call is non-blocking: the trainer
    waits on the futures and drops the output) routes the pass's zorro metrics as ``zorro/values/*``;
    ``_update_critic`` keeps verl's ``critic/*`` metrics and adds ``zorro/effective_mfu/critic``; both stamp the batch
    for the critic engine's balance check first (verl replaces ``extra_info`` at every worker call)."""
    import verl.trainer.ppo.v1.trainer_base as tb
    from omegaconf import OmegaConf
    from tensordict import TensorDict
    from transfer_queue import KVBatchMeta

    from zorro_verl.integrations.verl.v09.markers import BALANCE_MARKER_KEY

    stored, seen = {}, {}
    fake_tq = types.SimpleNamespace(
        kv_batch_get=lambda keys, partition_id, select_fields: TensorDict(
            {"values": torch.zeros(len(keys), 3), "response_mask": torch.ones(len(keys), 3)}, batch_size=[len(keys)]),
        kv_batch_put=lambda keys, partition_id, fields: stored.update(fields=fields))
    monkeypatch.setattr(tb, "tq", fake_tq)
    monkeypatch.setattr(tb, "response_from_nested", lambda x, mask: x)
    import ray

    monkeypatch.setattr(ray, "get", lambda refs: refs)  # the stand-in's futures are the ranks' outputs themselves

    class Future:  # verl's DataProtoFuture: one future per rank; its get() refuses transfer-queue metadata
        def __init__(self, batch):
            rank = [KVBatchMeta(partition_id="train", keys=batch.keys, tags=batch.tags, extra_info={"metrics": {
                "zorro/dedup_ratio": d, "zorro/computed_tokens": 100.0, "zorro/prompt_tokens_saved": saved,
                "zorro/fallback_batches": 0.0, "mfu": 0.3}}) for d, saved in ((2.0, 100.0), (4.0, 300.0))]
            self.futures = [*rank, None]  # a rank without outputs

        def get(self):
            raise AssertionError("DataProtoFuture.get: not a DataProto or TensorDict")

    def infer_batch(batch):
        seen["values"] = dict(batch.extra_info)
        return Future(batch)

    def train_mini_batch(batch):
        seen["update"] = dict(batch.extra_info)
        return types.SimpleNamespace(get=lambda: {"metrics": {
            "critic/vf_loss": [0.5], "mfu": [0.4], "zorro/computed_tokens": [50.0],
            "zorro/prompt_tokens_saved": [150.0], "zorro/dedup_ratio": [4.0]}})

    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {"n": 2, "temperature": 1.0}},
                            "critic": {"ppo_mini_batch_size": 1, "ppo_epochs": 1, "data_loader_seed": 0,
                                       "shuffle": False}})
    me = types.SimpleNamespace(config=cfg, critic_wg=types.SimpleNamespace(infer_batch=infer_batch,
                                                                           train_mini_batch=train_mini_batch))
    metrics = {}
    tb.PPOTrainer._compute_values(me, _kv(["a_0_0", "a_1_0"], [4, 4]), metrics)
    assert seen["values"][BALANCE_MARKER_KEY]
    assert metrics["zorro/values/dedup_ratio"] == pytest.approx(3.0)
    assert metrics["zorro/values/fallback_batches"] == 0.0
    assert metrics["zorro/values/computed_tokens"] == pytest.approx(100.0)
    assert metrics["zorro/effective_mfu/values"] == pytest.approx(0.3 * 100 / 300)
    assert me.critic_wg.infer_batch is infer_batch and "values" in stored["fields"].keys()
    metrics = {}
    tb.PPOTrainer._update_critic(me, _kv(["a_0_0", "a_1_0"], [4, 4]), metrics)
    assert seen["update"][BALANCE_MARKER_KEY]
    assert metrics["critic/vf_loss"] == 0.5 and metrics["critic/zorro/dedup_ratio"] == 4.0
    assert metrics["perf/mfu/critic"] == pytest.approx(0.4)
    assert metrics["zorro/effective_mfu/critic"] == pytest.approx(0.4 * 50 / 200)


def test_v1_real_trainer_warns_when_micro_batch_cuts_groups(caplog):
    """``zorro.rollout_n`` sizes fixed micro-batches: a ``ppo_micro_batch_size_per_gpu`` that is not a multiple of
    it cuts groups, warned once and counted."""
    PPOTrainer, me = _v1_trainer(dp=1, mini=2, n=4, rollout_n=4)
    me.config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 6
    metrics = {}
    with caplog.at_level("WARNING"):
        PPOTrainer._balance_batch(me, _kv([f"{u}_{s}_0" for u in "ab" for s in range(4)], [5] * 8), metrics)
    assert metrics["zorro/balance_micro_batch_misaligned"] == 1
    assert "ppo_micro_batch_size_per_gpu=6 is not a multiple of zorro.rollout_n=4" in caplog.text
    me.config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 8
    ok = {}
    PPOTrainer._balance_batch(me, _kv([f"{u}_{s}_0" for u in "ab" for s in range(4)], [5] * 8), ok)
    assert "zorro/balance_micro_batch_misaligned" not in ok


def test_tree_balance_keeps_clusters_whole_and_counts_shared_tokens_once():
    """sharing=prefix: rows sharing a system prompt (different questions) form one cluster; clusters stay whole on
    a rank and a rank's cost is its prefix trees' tokens."""
    from zorro_verl.integrations.verl.v09.balance import tree_balance
    from zorro_verl.packing import build_plan
    from zorro_verl.testing import batch_from_rows, shared_system_rows

    rows = []
    for seed in range(4):  # 4 clusters (different system prompts), 2 questions x 2 samples each
        rows += shared_system_rows(2, 2, system_len=12, question_len=3, response_len=4, vocab_size=100, seed=seed)
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()
    b = batch_from_rows([rows[i] for i in perm])
    R = b["responses"].shape[1]
    bal = tree_balance(b["input_ids"], b["attention_mask"], R, 2, min_shared_len=4)
    assert [len(r) for r in bal.ranks] == [8, 8] and bal.split_groups == 0
    for rank_rows, cost in zip(bal.ranks, bal.costs):
        sub = {k: v[rank_rows] for k, v in b.items()}
        plan = build_plan(sub["input_ids"], sub["attention_mask"], R, sharing="prefix", min_shared_len=4)
        assert plan.G == 2 and plan.T == cost  # two whole clusters; the cost is the tree's token count


def test_v1_tree_costs_nest_multi_output_sessions():
    from zorro_verl.integrations.verl.v09.balance import v1_tree_costs

    # uid a: one session with 3 nested outputs (prompt 10, each turn +5); uid b: two sessions of one output each
    keys = ["a_0_0", "a_0_1", "a_0_2", "b_0_0", "b_1_0", "pad"]
    tags = [{"prompt_len": 10, "seq_len": 15}, {"prompt_len": 15, "seq_len": 20}, {"prompt_len": 20, "seq_len": 25},
            {"prompt_len": 8, "seq_len": 12}, {"prompt_len": 8, "seq_len": 11}, {"is_padding": True, "seq_len": 1}]
    g, p, r = v1_tree_costs(keys, tags)
    assert g[:3] == [0, 0, 0] and g[3:5] == [1, 1] and g[5] not in g[:5]
    assert p[:5] == [10, 10, 10, 8, 8]
    assert r[:5] == [0, 0, 15, 4, 3]  # the longest output of a session pays it; the others are inside it


def test_trainer_settings_follow_the_actor_engine_node():
    """The trainer's balancing reads the zorro node of the actor's engine: ``megatron`` for strategy megatron (the
    Megatron preset), ``fsdp_config`` otherwise; a zorro node in the other engine's place does not count."""
    from omegaconf import OmegaConf

    from zorro_verl.integrations.verl.v09.balance import trainer_zorro_settings

    node = {"zorro": {"enable": True, "rollout_n": 4, "group_balance": True}}
    mega = OmegaConf.create({"actor_rollout_ref": {"actor": {"strategy": "megatron", "megatron": node,
                                                             "fsdp_config": {}}}})
    fsdp = OmegaConf.create({"actor_rollout_ref": {"actor": {"strategy": "fsdp2", "fsdp_config": node,
                                                             "megatron": {}}}})
    wrong = OmegaConf.create({"actor_rollout_ref": {"actor": {"strategy": "megatron", "fsdp_config": node}}})
    assert trainer_zorro_settings(mega).enable and trainer_zorro_settings(mega).rollout_n == 4
    assert trainer_zorro_settings(fsdp).enable
    assert not trainer_zorro_settings(wrong).enable
