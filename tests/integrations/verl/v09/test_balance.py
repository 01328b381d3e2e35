"""Group-aware DP balancing hooked into verl's trainers: whole groups per rank, equal rows per rank, switchable."""

import types

import pytest
import torch

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


def _trainer_self(enable, group_balance=True, dp=4):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4, "fsdp_config": {
        "zorro": {"enable": enable, "group_balance": group_balance}}}}})
    return types.SimpleNamespace(config=cfg, actor_rollout_wg=None, _get_dp_size=lambda wg, role: dp)


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
    """verl's V1 PPOTrainer needs transfer_queue (not installed here): the hook runs on a stand-in module that has
    the two names it uses, with KVBatchMeta-like keys ``{uid}_{session}_{i}`` and verl's tags."""
    from zorro_verl.integrations.verl.v09.balance import install_v1_hook, v1_group_of_key

    class Batch:
        def __init__(self, keys, tags):
            self.keys, self.tags = list(keys), list(tags)

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
    me = types.SimpleNamespace(config=_trainer_self(True).config, actor_rollout_wg=wg,
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
