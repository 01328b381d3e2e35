"""Deduplication of each DP placement on a realistic GRPO batch, through verl 0.9.1's real V1 trainer method.

    .venv/bin/python scripts/balance_dedup.py [--prompts 256] [--n 8] [--mini 64] [--dp 8] [--seed 0]

The batch: ``prompts`` x ``n`` rollouts, siblings adjacent (as verl's rollout stores them), prompt lengths uniform in
[128, 1024], response lengths long-tailed (log-normal, median 300, capped at 4096). ``PPOTrainer._balance_batch``
runs with zorro off (verl's placement), ``keep_minibatches`` (default) and ``whole_groups``; verl's worker then cuts
each rank's chunk into mini-batches (``tensordict_utils.make_iterator``). Reported per placement:

* train dedup: ordinary tokens / deduplicated tokens over every (rank, mini-batch) slot, each group's prompt once
  per slot (an upper bound for what the micro-batches of a slot reach: dynamic micro-batches may cut a group);
* fwd dedup: the same per rank (the old-log-prob and reference passes run a rank's whole chunk);
* busiest slot: the largest deduplicated (rank, mini-batch) cost over the mean (1.0 = perfectly even);
* same steps: whether every optimizer step holds the same global rows as verl's placement.
"""

from __future__ import annotations

import argparse
import random
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _batch(prompts: int, n: int, seed: int):
    rng = random.Random(seed)
    keys, plens, rlens = [], [], []
    for u in range(prompts):
        p = rng.randint(128, 1024)
        for s in range(n):
            keys.append(f"u{u}_{s}_0")
            plens.append(p)
            rlens.append(min(4096, max(1, int(rng.lognormvariate(5.7, 0.9)))))
    return keys, plens, rlens


def _place(mode, keys, plens, rlens, n, mini, dp):
    from omegaconf import OmegaConf
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    import zorro_verl.integrations.verl.v09.balance as balance

    balance.install_v1_hook(sys.modules["verl.trainer.ppo.v1.trainer_base"])
    zorro = {"enable": mode != "verl", "rollout_n": n,
             "group_balance_mode": mode if mode != "verl" else "keep_minibatches"}
    cfg = OmegaConf.create({"trainer": {"critic_warmup": 0}, "actor_rollout_ref": {
        "rollout": {"n": n}, "actor": {"ppo_mini_batch_size": mini, "ppo_epochs": 1, "shuffle": False,
                                       "data_loader_seed": 42, "fsdp_config": {"zorro": zorro}}}})
    me = types.SimpleNamespace(config=cfg, use_critic=False, global_steps=1,
                               actor_rollout_wg=types.SimpleNamespace(_dispatch_info={"actor": list(range(dp))}),
                               tokenizer=types.SimpleNamespace(eos_token_id=0))
    me._get_required_batch_multiple = types.MethodType(PPOTrainer._get_required_batch_multiple, me)
    tags = [{"status": "success", "prompt_len": p, "response_len": r, "seq_len": p + r} for p, r in zip(plens, rlens)]
    out = PPOTrainer._balance_batch(me, KVBatchMeta(partition_id="train", keys=list(keys), tags=tags), {})
    index = {k: i for i, k in enumerate(keys)}
    return [index[k] for k in out.keys]


def _slots(order, dp, mini_rows):
    chunk = len(order) // dp
    per = mini_rows // dp
    return {(k, j): order[k * chunk + j * per:k * chunk + (j + 1) * per]
            for k in range(dp) for j in range(chunk // per)}


def _cost(rows, group, plens, rlens):
    return sum({group[b]: plens[b] for b in rows}.values()) + sum(rlens[b] for b in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--mini", type=int, default=64, help="ppo_mini_batch_size (prompts)")
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    from tests.support.verl_cpu_platform import use_cpu_platform

    use_cpu_platform()
    keys, plens, rlens = _batch(a.prompts, a.n, a.seed)
    group = [k.split("_")[0] for k in keys]
    ordinary = sum(plens) + sum(rlens)
    ideal = ordinary / (sum({g: p for g, p in zip(group, plens)}.values()) + sum(rlens))
    mini_rows = a.mini * a.n
    results, stock_sets = [], None
    for mode in ("verl", "keep_minibatches", "whole_groups"):
        order = _place(mode, keys, plens, rlens, a.n, a.mini, a.dp)
        slots = _slots(order, a.dp, mini_rows)
        steps = [sorted(b for (k, j), rows in slots.items() if j == step for b in rows)
                 for step in range(len(order) // a.dp // (mini_rows // a.dp))]
        stock_sets = steps if stock_sets is None else stock_sets
        costs = [_cost(rows, group, plens, rlens) for rows in slots.values()]
        chunk = len(order) // a.dp
        fwd = sum(_cost(order[k * chunk:(k + 1) * chunk], group, plens, rlens) for k in range(a.dp))
        results.append((mode, ordinary / sum(costs), ordinary / fwd, max(costs) / (sum(costs) / len(costs)),
                        "yes" if steps == stock_sets else "no"))
    print(f"batch: {a.prompts} prompts x n={a.n} = {len(keys)} rows, ppo_mini_batch_size={a.mini} "
          f"({len(keys) // mini_rows} mini-batches), dp={a.dp}; prompts 128-1024 tokens (mean "
          f"{sum(plens) / len(plens):.0f}), responses log-normal (mean {sum(rlens) / len(rlens):.0f}, max "
          f"{max(rlens)}); ideal dedup (every group whole) {ideal:.3f}")
    print(f"{'placement':<18} {'train dedup':>11} {'fwd dedup':>10} {'busiest slot':>13} {'same steps as verl':>19}")
    for mode, tr, fw, busy, same in results:
        print(f"{mode:<18} {tr:>11.3f} {fw:>10.3f} {busy:>13.3f} {same:>19}")


if __name__ == "__main__":
    main()
