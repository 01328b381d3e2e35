"""verl's SFT trainer (``verl.trainer.sft_trainer``) on the zorro FSDP engine with ``sharing=prefix`` vs the stock
engine, on multi-turn SFT samples that share a long system prompt and earlier turns (each conversation cut after
every assistant turn), the loss over every assistant token.

* fp64, model level: :func:`~zorro_verl.integrations.verl.v09.batching.sft_split` + the prefix-tree plan +
  ``zorro_step`` vs the ordinary per-row forward (full logits) under verl's ``sft_loss`` formula: log-probs at
  every loss position, the loss and every gradient (<= 1e-9 abs / 1e-8 relative, as the tree-step tests).
* fp32, engine level: the batches verl's SFT trainer builds (its ``SFTTensorCollator``, its meta data, its
  ``sft_loss``) through the stock ``FSDPEngineWithLMHead`` and the zorro engine, two optimizer steps (SGD), FSDP2 and
  FSDP1, fixed and dynamic micro-batches: log-probs at the loss positions <= 1e-5 abs; loss, grad norm and every
  gradient <= 1e-5 relative; the validation pass's loss; zorro's tree and dedup metrics; no fallback.
* refusals: a sample whose first token is in the loss mask.
"""


import pytest
import torch

from tests.support.verl_engines import STEPS_OPTIM, engine_grads, sft_batch, sft_loss_fn

pytestmark = pytest.mark.usefixtures("verl_cpu")  # skips without verl 0.9

ATOL = 1e-5
RTOL = 1e-5
PREFIX = {"sharing": "prefix", "min_shared_len": 4}


def _samples(seed=0, conversations=3, turns=3):
    from zorro_verl.testing import sft_conversations

    return sft_conversations(conversations, turns, system_len=16, user_len=4, assistant_len=5, vocab_size=100,
                             seed=seed)


def _interleave(samples):
    """Samples of different conversations interleaved (the sampler shuffles)."""
    order = sorted(range(len(samples)), key=lambda i: (i * 7) % len(samples))
    return [samples[i] for i in order]


def loss_positions(td) -> torch.Tensor:
    """``[total]`` bool over the jagged tokens: the positions whose log-prob ``sft_loss`` reads (its rolled mask)."""
    return torch.roll(td["loss_mask"].values(), shifts=-1, dims=0).bool()


def _common_prefix(rows) -> int:
    n = min(r.numel() for r in rows)
    for k in range(n):
        if any(r[k] != rows[0][k] for r in rows):
            return k
    return n


# ---------------------------------------------------------------- fp64, model level
def test_model_level_fp64_matches_per_row_forward():
    from verl.utils.dataset.dataset_utils import DatasetPadMode, SFTTensorCollator

    from zorro_verl.integrations.transformers import install_zorro, zorro_step
    from zorro_verl.integrations.verl.v09.batching import _to_verl_padded, row_lengths, sft_split, sft_unsupported
    from zorro_verl.packing import build_plan
    from zorro_verl.testing import grads_of, max_rel_grad_error, tiny_model

    samples = _interleave(_samples(seed=3))
    td = SFTTensorCollator(DatasetPadMode.NO_PADDING)(samples)
    from verl.utils import tensordict_utils as tu

    td = tu.get_tensordict(tensor_dict=td)
    assert sft_unsupported(td) is None
    sft_split(td)
    ref, z = tiny_model("qwen3"), tiny_model("qwen3")
    install_zorro(z)
    n_tok = sum(int(s["loss_mask"].sum()) for s in samples)
    # the ordinary forward, verl's sft_loss: -sum(log p(x_{t+1}) * loss_mask[t+1]) / tokens
    lp_ref, loss_ref = [], 0.0
    for s in samples:
        logp = torch.log_softmax(ref(input_ids=s["input_ids"][None], use_cache=False).logits[0, :-1].double(), -1)
        lp = logp.gather(-1, s["input_ids"][1:, None]).squeeze(-1)
        m = s["loss_mask"][1:].bool()
        lp_ref.append(lp[m])
        loss_ref = loss_ref - lp[m].sum() / n_tok
    loss_ref.backward()
    # zorro: the split rows as one prefix tree
    p, r = row_lengths(td)
    ids, row, col = _to_verl_padded(td["input_ids"], p, r, int(p.max()), int(r.max()))
    am = torch.zeros_like(ids)
    am[row, col] = 1
    lm, _, _ = _to_verl_padded(td["loss_mask"], p, r, int(p.max()), int(r.max()))
    plan = build_plan(ids, am, int(r.max()), sharing="prefix", min_shared_len=4)
    lp, _ = zorro_step(z, plan, backend="sdpa")
    resp_mask = lm[:, int(p.max()):][am[:, int(p.max()):].bool()].bool()  # [N] response tokens, row order
    loss = -(lp[resp_mask]).sum() / n_tok
    loss.backward()
    lp_ref = torch.cat(lp_ref)
    assert lp_ref.numel() == n_tok == int(resp_mask.sum())
    err_lp = (lp[resp_mask] - lp_ref).abs().max().item()
    err_loss = abs(loss.item() - loss_ref.item())
    g_ref = grads_of(ref)
    scale = max(g.abs().max().item() for g in g_ref.values())
    err_grad = max_rel_grad_error(g_ref, grads_of(z), floor=1e-6 * scale)[0]
    print(f"fp64 SFT: log-prob {err_lp:.1e}, loss {err_loss:.1e}, grad rel {err_grad:.1e}; tokens "
          f"{plan.T} of {plan.ordinary_tokens}, tree levels {plan.tree.levels}")
    assert err_lp <= 1e-9 and err_loss <= 1e-9 and err_grad <= 1e-8
    # the system prompt once, each conversation once (a sample cut after an earlier turn is a prefix of the longest)
    sys_len = _common_prefix([s["input_ids"] for s in samples])
    longest = {}
    for s in samples:
        key = tuple(s["input_ids"][:sys_len + 2].tolist())  # the conversation's first user tokens
        longest[key] = max(longest.get(key, 0), s["input_ids"].numel())
    assert len(longest) == 3 and sys_len >= 15
    assert plan.T == sys_len + sum(n - sys_len for n in longest.values()) < 0.5 * plan.ordinary_tokens


def test_split_at_the_first_loss_token():
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode, SFTTensorCollator

    from zorro_verl.integrations.verl.v09.batching import is_sft_batch, row_lengths, sft_split, sft_unsupported

    samples = _samples(seed=1, conversations=2, turns=2)
    none = {"input_ids": torch.arange(1, 7), "loss_mask": torch.zeros(6, dtype=torch.long),
            "position_ids": torch.arange(6)}  # no loss token: all prompt
    td = tu.get_tensordict(tensor_dict=SFTTensorCollator(DatasetPadMode.NO_PADDING)(samples + [none]))
    assert is_sft_batch(td) and sft_unsupported(td) is None
    sft_split(td)
    assert not is_sft_batch(td)
    p, r = row_lengths(td)
    for k, s in enumerate(samples):
        first = int(s["loss_mask"].nonzero()[0])
        assert int(p[k]) == first and int(r[k]) == s["input_ids"].numel() - first
        assert torch.equal(td["prompts"][k], s["input_ids"][:first])
    assert int(p[-1]) == 6 and int(r[-1]) == 0


# ---------------------------------------------------------------- fp32, verl's engine
@pytest.fixture(scope="module")
def engines(verl_cpu, tiny_ckpt, strategy):
    """The stock and the zorro engine on the same checkpoint; every test feeds both the same batches in the same
    order, so their weights stay equal step for step (module scope: built once per strategy)."""
    from tests.support.verl_engines import build_engine

    kw = dict(strategy=strategy, optim_overrides=STEPS_OPTIM)
    return build_engine(tiny_ckpt, zorro=False, **kw), build_engine(tiny_ckpt, zorro=True, zorro_settings=PREFIX, **kw)


def _train(engine, td):
    with engine.train_mode(zero_grad_on_exit=False):  # keep the grads for the comparison
        out = engine.train_batch(td.clone(), loss_function=sft_loss_fn())
    return out, engine_grads(engine)


@pytest.mark.parametrize("dynamic", [False, True])
def test_two_sft_steps_match_stock(engines, dynamic):
    from zorro_verl.testing import grad_rel_error

    stock, zorro = engines
    for step in range(2):
        td = sft_batch(_interleave(_samples(seed=10 + step)), dynamic=dynamic)
        (a, ga), (b, gb) = _train(stock, td), _train(zorro, td)
        pos = loss_positions(td)
        lp_a, lp_b = (o["model_output"]["log_probs"].values()[pos] for o in (a, b))
        err_lp = (lp_a - lp_b).abs().max().item()
        la, lb = sum(a["loss"]), sum(b["loss"])
        gna, gnb = float(a["metrics"]["grad_norm"]), float(b["metrics"]["grad_norm"])
        err_g = grad_rel_error(ga, gb)
        m = b["metrics"]
        print(f"step {step} dynamic={dynamic}: log-prob {err_lp:.1e}, loss {abs(la - lb) / abs(la):.1e}, grad norm "
              f"{abs(gna - gnb) / gna:.1e}, grads {err_g:.1e}; dedup {m['zorro/dedup_ratio'][0]:.2f}, tree depth "
              f"{m['zorro/tree_depth'][0]:.0f}")
        assert pos.sum() > 40 and lp_a.abs().max() > 1.0 and err_lp <= ATOL
        assert abs(la) > 1e-3 and abs(la - lb) <= RTOL * abs(la)
        assert gna > 1e-4 and abs(gna - gnb) <= RTOL * gna
        assert err_g <= RTOL and len(gb) == len(ga) > 0
        assert m["zorro/fallback_batches"] == [0.0] and m["zorro/tree_depth"][0] >= 2
        assert m["zorro/dedup_ratio"][0] > 1.3 and m["zorro/balance_hooks_missing"] == [0.0]


def test_validation_pass_matches_stock(engines):
    """The SFT trainer's validation step: ``infer_batch`` with its ``sft_loss`` (no optimizer step)."""
    stock, zorro = engines
    td = sft_batch(_interleave(_samples(seed=20)), dynamic=True)
    outs = []
    for eng in (stock, zorro):
        with eng.eval_mode():
            outs.append(eng.infer_batch(td.clone(), loss_function=sft_loss_fn()))
    la, lb = sum(outs[0]["loss"]), sum(outs[1]["loss"])
    assert abs(la) > 1e-3 and abs(la - lb) <= RTOL * abs(la)
    pos = loss_positions(td)
    lp_a, lp_b = (o["model_output"]["log_probs"].values()[pos] for o in outs)
    assert (lp_a - lp_b).abs().max().item() <= ATOL


def test_first_token_in_loss_mask_is_refused(engines):
    _, zorro = engines
    samples = _samples(seed=30, conversations=2, turns=1)
    samples[1] = {**samples[1], "loss_mask": torch.ones_like(samples[1]["loss_mask"])}
    with pytest.raises(ValueError, match="first token is in the loss_mask"):
        _train(zorro, sft_batch(samples, dynamic=True))


def test_documented_sft_launch_builds_the_zorro_engine():
    """The override line of docs/verl-fsdp.md's SFT block, composed with verl 0.9.1's own ``sft_trainer_engine``
    config, gives the engine config verl's SFT trainer builds (``omega_conf_to_dataclass(config.engine)``): zorro's,
    enabled, prefix sharing, resolved by verl's registry to the zorro engine."""
    import re
    from pathlib import Path

    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine import EngineRegistry

    from tests.support import REPO_ROOT
    from zorro_verl.integrations.verl.settings import settings_of

    text = (REPO_ROOT / "docs" / "verl-fsdp.md").read_text()
    block = re.search(r"<!-- zorro-sft-overrides -->\s*```bash\n(.*?)```", text, re.S)
    assert block, "docs/verl-fsdp.md lost its SFT block"
    overrides = [t for t in block.group(1).split() if "=" in t and not t.startswith("--")]
    assert len(overrides) == 4
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        cfg = compose(config_name="sft_trainer_engine", overrides=overrides)
    engine_config = omega_conf_to_dataclass(cfg.engine)
    s = settings_of(engine_config)
    assert s.enable and s.sharing == "prefix" and cfg.data.pad_mode == "no_padding"
    assert getattr(EngineRegistry.get_engine_cls("language_model", engine_config.strategy), "zorro_engine", False)
