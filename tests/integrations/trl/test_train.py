"""The real ``trl.GRPOTrainer.train()`` on CPU, stock vs zorro, 2 SGD steps on the same seed: the per-step loss,
grad norm, KL and entropy logged by TRL, and the weights after the steps, must agree to fp32 rounding.

Generation is seeded (HF ``generate`` on the tiny fp32 Qwen3, zorro off for it); each run records its completions
and the test asserts they are identical, so the comparison is on identical completions. Covered: every TRL 1.16
loss type with (num_iterations 1, accumulation 1, beta > 0: the reference a separate model) and with
(num_iterations 2, accumulation 2, beta 0: old log-probs computed), LoRA (the reference = the adapter disabled),
non-reentrant and reentrant gradient checkpointing, the one-line ``enable()`` on an unmodified GRPOTrainer.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from transformers import AutoModelForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from tests.support.trl_assets import dataset, length_reward  # noqa: E402
from zorro_verl.integrations import trl as ztrl  # noqa: E402

LOSS_TYPES = ztrl.SUPPORTED_LOSS_TYPES
#: Logged scalars compared per step (relative 1e-5, absolute floor 1e-7 for values near 0 such as the first loss).
KEYS = ("loss", "grad_norm", "kl", "entropy")
RTOL, ATOL, WEIGHT_ATOL = 1e-5, 1e-7, 1e-6


def _config(tmp, loss_type="dapo", beta=0.04, ga=1, iters=1, reentrant=None, lora=False):
    kw = {}
    if reentrant is not None:
        kw["gradient_checkpointing_kwargs"] = {"use_reentrant": reentrant}
    if loss_type == "luspo":
        kw["importance_sampling_level"] = "sequence"  # the paper's setup (TRL warns otherwise)
    return GRPOConfig(output_dir=str(tmp), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=8, use_cpu=True, report_to="none", beta=beta, loss_type=loss_type,
                      gradient_accumulation_steps=ga, num_iterations=iters, max_steps=2, logging_steps=1, seed=1,
                      optim="sgd", learning_rate=0.1 if not lora else 0.5, bf16=False, save_strategy="no",
                      temperature=0.9, disable_tqdm=True, **kw)


def _run(cls, assets, tmp, lora=False, zorro=None, **cfg):
    out, tok = assets
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    kw = {}
    if lora:
        from peft import LoraConfig

        kw["peft_config"] = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    if zorro is not None:
        kw["zorro"] = zorro
    tr = cls(model=model, reward_funcs=length_reward, args=_config(tmp, lora=lora, **cfg),
             train_dataset=dataset(4 * cfg.get("ga", 1)), processing_class=tok, **kw)
    completions = []
    gen = tr._generate_and_score_completions

    def recorded(*a, **k):
        out = gen(*a, **k)
        completions.append(out["completion_ids"].clone())
        return out

    tr._generate_and_score_completions = recorded
    tr.train()
    logs = [h for h in tr.state.log_history if "loss" in h]
    weights = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    return logs, weights, completions


def _compare(stock, zorro):
    (ls, ws, cs), (lz, wz, cz) = stock, zorro
    assert len(cs) == len(cz) >= 1 and all(torch.equal(a, b) for a, b in zip(cs, cz)), "completions differ"
    assert len(ls) == len(lz) == 2
    worst = {}
    for a, b in zip(ls, lz):
        for k in KEYS:
            if k not in a:
                continue
            assert b[k] == pytest.approx(a[k], rel=RTOL, abs=ATOL), (k, a[k], b[k])
            worst[k] = max(worst.get(k, 0.0), abs(a[k] - b[k]))
        assert b["zorro/fallbacks"] == 0 and b["zorro/dedup_ratio"] > 1.0, b
    assert ws.keys() == wz.keys()
    moved = max((ws[n] - wz[n]).abs().max().item() for n in ws)
    assert moved <= WEIGHT_ATOL, moved
    print(f"  max |d| per key {worst}, weights {moved:.1e}, dedup {[b['zorro/dedup_ratio'] for b in lz]}")


CASES = ([pytest.param(dict(loss_type=lt), id=f"{lt}-beta0.04-ga1-it1") for lt in LOSS_TYPES]
         + [pytest.param(dict(loss_type=lt, beta=0.0, ga=2, iters=2), id=f"{lt}-beta0-ga2-it2") for lt in LOSS_TYPES]
         + [pytest.param(dict(loss_type="bnpo", lora=True), id="lora-bnpo-beta0.04"),
            pytest.param(dict(loss_type="grpo", lora=True, beta=0.04, ga=2, iters=2), id="lora-grpo-ga2-it2"),
            pytest.param(dict(loss_type="dr_grpo", reentrant=True), id="reentrant-checkpointing"),
            pytest.param(dict(loss_type="dapo", zorro={"logits_optimization": "none"}), id="logits-none"),
            pytest.param(dict(loss_type="dapo", reentrant=False, ga=2), id="nonreentrant-ga2")])


@pytest.mark.parametrize("cfg", CASES)
def test_train_matches_stock(cfg, trl_assets, tmp_path):
    cfg = dict(cfg)
    settings = cfg.pop("zorro", None)
    stock = _run(GRPOTrainer, trl_assets, tmp_path / "s", **cfg)
    zorro = _run(ztrl.ZorroGRPOTrainer, trl_assets, tmp_path / "z", zorro=settings, **cfg)
    _compare(stock, zorro)


def test_enable_switches_an_unmodified_trainer(trl_assets, tmp_path):
    """``enable()`` patches ``trl.GRPOTrainer`` itself: the script's own class runs zorro (equal to stock), and
    ``disable()`` restores stock (no zorro metric)."""
    stock = _run(GRPOTrainer, trl_assets, tmp_path / "s")
    assert not any(k.startswith("zorro/") for k in stock[0][0])
    ztrl.enable(attention_backend="sdpa")
    try:
        assert ztrl.is_enabled()
        zorro = _run(GRPOTrainer, trl_assets, tmp_path / "z")
    finally:
        ztrl.disable()
    _compare(stock, zorro)
    again = _run(GRPOTrainer, trl_assets, tmp_path / "a")
    assert not any(k.startswith("zorro/") for k in again[0][0])
    assert all(getattr(GRPOTrainer, n) is ztrl.trainer._STOCK[n] for n in ztrl.trainer._METHODS)


def test_train_hands_the_model_back(trl_assets, tmp_path):
    """After ``train()`` the model has its own attention again: ``generate`` and ``save_pretrained`` outside the
    trainer work and save no zorro attention in the config."""
    out, tok = trl_assets
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tr = ztrl.ZorroGRPOTrainer(model=model, reward_funcs=length_reward, args=_config(tmp_path / "t"),
                               train_dataset=dataset(4), processing_class=tok)
    tr.train()
    m = tr.accelerator.unwrap_model(tr.model)
    assert not ztrl.trainer.is_installed(m) and m.config._attn_implementation != "zorro"
    ids = tok.apply_chat_template([{"role": "user", "content": "Say done."}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    m.generate(ids, max_new_tokens=3, do_sample=False)
    m.save_pretrained(tmp_path / "saved")
    assert "zorro" not in (tmp_path / "saved" / "config.json").read_text()


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_group_order_keeps_each_step(loss_type, trl_assets, tmp_path):
    """``micro_batch_order='groups'`` at accumulation 2: each micro-batch holds whole prompt groups (more shared),
    and each optimizer step's gradient is stock's: the logged loss (a sum over the step's micro-batches), the grad norm
    and the weights after 2 steps agree to fp32 rounding. (TRL's KL / entropy metrics are per-micro-batch means,
    averaged: they follow the grouping, so they are not compared.)"""
    cfg = dict(loss_type=loss_type, ga=2)
    (ls, ws, cs) = _run(GRPOTrainer, trl_assets, tmp_path / "s", **cfg)
    (lz, wz, cz) = _run(ztrl.ZorroGRPOTrainer, trl_assets, tmp_path / "z", zorro={"micro_batch_order": "groups"},
                        **cfg)
    (lr, _, _) = _run(ztrl.ZorroGRPOTrainer, trl_assets, tmp_path / "r", **cfg)  # stock order, for the ratio
    assert len(cs) == len(cz) >= 1 and all(torch.equal(a, b) for a, b in zip(cs, cz)), "completions differ"
    for a, b in zip(ls, lz):
        for k in ("loss", "grad_norm"):
            assert b[k] == pytest.approx(a[k], rel=RTOL, abs=ATOL), (k, a[k], b[k])
    moved = max((ws[n] - wz[n]).abs().max().item() for n in ws)
    assert moved <= WEIGHT_ATOL, moved
    grouped = [b["zorro/dedup_ratio"] for b in lz]
    scattered = [b["zorro/dedup_ratio"] for b in lr]
    assert all(g > s for g, s in zip(grouped, scattered)), (grouped, scattered)
    print(f"  {loss_type}: weights {moved:.1e}; dedup ratio grouped {grouped} vs stock order {scattered}")
