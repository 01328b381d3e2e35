"""The log-prob seam itself: ``GRPOTrainer._get_per_token_logps_and_entropies`` (stock) vs zorro's override, on
TRL-layout batches (left-padded prompts, right-padded completions, rows of a prompt scattered as after
``_prepare_inputs``' shuffle, a truncated row with its whole completion masked, stock's row chunks).

* fp64: zorro's method on an fp64 model vs the ordinary fp64 forward (the model's own logits, log-softmax of
  ``logits / T``): <= 1e-10. (TRL's own fused head computes in fp32 even for fp64 models, so stock's method is
  compared in fp32 below.)
* fp32: zorro's method vs stock's method: log-probs / entropies <= 1e-5 abs, pads exactly 0.
* fp32 gradients: ``_compute_loss(...).backward()`` for every loss type, beta 0 and > 0, the entropy bonus:
  the loss and every parameter gradient equal to rel 1e-5 (per tensor, vs its max).
* refusals and the ``warn`` fallback, the version check, the settings.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from transformers import AutoModelForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from tests.support.trl_assets import dataset, length_reward  # noqa: E402
from zorro_verl.integrations import trl as ztrl  # noqa: E402
from zorro_verl.integrations.trl import trainer as ztrainer  # noqa: E402

V, T = 512, 0.9


def _trainer(cls, assets, tmp, dtype=torch.float32, zorro=None, **cfg):
    out, tok = assets
    model = AutoModelForCausalLM.from_pretrained(out, dtype=dtype)
    args = GRPOConfig(output_dir=str(tmp), per_device_train_batch_size=8, num_generations=4, max_completion_length=16,
                      use_cpu=True, report_to="none", temperature=T, save_strategy="no",
                      disable_tqdm=True, **{"beta": 0.04, "bf16": False, **cfg})
    kw = {} if zorro is None else {"zorro": zorro}
    tr = cls(model=model, reward_funcs=length_reward, args=args, train_dataset=dataset(4), processing_class=tok, **kw)
    tr.current_gradient_accumulation_steps = 1
    tr.model.train()
    return tr


def _batch(seed=0, plens=(13, 7, 10), n=3, C=16, pad=3):
    """``(input_ids [B, P+C], attention_mask [B, P+C], C)``: len(plens) prompts x n completions, rows shuffled, row 4's
    completion fully masked (``mask_truncated_completions``)."""
    g = torch.Generator().manual_seed(seed)
    P = max(plens)
    prompts = [torch.randint(5, V, (p,), generator=g) for p in plens]
    ids, am = [], []
    for pr in prompts:
        for _ in range(n):
            c = int(torch.randint(1, C + 1, (), generator=g))
            ids.append(torch.cat([torch.full((P - len(pr),), pad), pr, torch.randint(5, V, (c,), generator=g),
                                  torch.full((C - c,), pad)]))
            am.append(torch.cat([torch.zeros(P - len(pr)), torch.ones(len(pr) + c), torch.zeros(C - c)]).long())
    perm = torch.randperm(len(ids), generator=g)
    ids, am = torch.stack(ids)[perm], torch.stack(am)[perm]
    am[4, P:] = 0
    return ids, am, C


@pytest.fixture(scope="module")
def pair32(trl_assets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("seam32")
    stock = _trainer(GRPOTrainer, trl_assets, tmp / "s")
    zorro = _trainer(ztrl.ZorroGRPOTrainer, trl_assets, tmp / "z", zorro={"attention_backend": "flash_copyfree"})
    zorro.model.load_state_dict(stock.model.state_dict())
    return stock, zorro


def _ordinary_fp64(model, ids, am, C, pad_positions=False):
    """The ordinary forward's log-probs / entropies of the completion tokens ``[B, C]`` (0 on pads), fp64.

    Positions ``0..L-1`` over each row's valid tokens (zorro's convention); ``pad_positions``: TRL's, none passed, so
    ``arange(S)`` counting the left pads. RoPE is relative, but HF computes its cos / sin in fp32, so the two differ
    by fp32 rounding (~3e-8 here in an fp64 model): the reference at fp64 precision uses zorro's positions."""
    pos = None if pad_positions else (am.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, -C - 1:-1].double() / T
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, ids[:, -C:, None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    m = am[:, -C:].bool()
    return lp * m, ent * m


@pytest.mark.parametrize("sharing,logits", [("prompt", "memory"), ("prefix", "memory"), ("prompt", "none"),
                                            ("prompt", "compute")])
def test_fp64_method_equals_the_ordinary_forward(trl_assets, tmp_path, sharing, logits):
    stock = _trainer(GRPOTrainer, trl_assets, tmp_path / "s", dtype=torch.float64)
    zorro = _trainer(ztrl.ZorroGRPOTrainer, trl_assets, tmp_path / "z", dtype=torch.float64,
                     zorro={"sharing": sharing, "min_shared_len": 4, "logits_optimization": logits})
    zorro.model.load_state_dict(stock.model.state_dict())
    ids, am, C = _batch()
    ref_lp, ref_ent = _ordinary_fp64(stock.model, ids, am, C)
    with torch.no_grad():
        lp, ent, aux = zorro._get_per_token_logps_and_entropies(zorro.model, ids, am, C, batch_size=4,
                                                                compute_entropy=True)
        lp_s, _, _ = stock._get_per_token_logps_and_entropies(stock.model, ids, am, C, batch_size=4)
    m = am[:, -C:].bool()
    assert aux is None and lp.dtype == torch.float64
    d_lp, d_ent = (lp - ref_lp).abs().max().item(), (ent - ref_ent).abs().max().item()
    assert d_lp <= 1e-10 and d_ent <= 1e-10, (d_lp, d_ent)
    assert bool((lp[~m] == 0).all() and (ent[~m] == 0).all())
    d_stock = (lp - lp_s.double()).abs().max().item()  # stock's fused head runs fp32
    d_pads = (lp - _ordinary_fp64(stock.model, ids, am, C, pad_positions=True)[0]).abs().max().item()
    assert d_stock <= 1e-5 and d_pads <= 1e-6, (d_stock, d_pads)
    print(f"  fp64 {sharing} {logits}: log-prob {d_lp:.1e}, entropy {d_ent:.1e} vs ordinary; {d_stock:.1e} vs "
          f"stock's method (fp32 head); {d_pads:.1e} vs the ordinary forward on TRL's pad-counting positions")


@pytest.mark.parametrize("batch_size", [None, 4])
@pytest.mark.parametrize("logits", ["memory", "none"])
def test_fp32_method_equals_stock(pair32, batch_size, logits):
    stock, zorro = pair32
    zorro._zorro.settings = ztrl.trl_settings(attention_backend="flash_copyfree", logits_optimization=logits)
    ids, am, C = _batch(seed=1)
    with torch.no_grad():
        lp_s, en_s, _ = stock._get_per_token_logps_and_entropies(stock.model, ids, am, C, batch_size, True)
        lp_z, en_z, _ = zorro._get_per_token_logps_and_entropies(zorro.model, ids, am, C, batch_size, True)
    m = am[:, -C:].bool()
    d_lp, d_en = (lp_s - lp_z).abs().max().item(), (en_s - en_z).abs().max().item()
    assert d_lp <= 1e-5 and d_en <= 1e-5, (d_lp, d_en)
    assert bool((lp_z[~m] == 0).all() and (en_z[~m] == 0).all())
    zorro._zorro.settings = ztrl.trl_settings(attention_backend="flash_copyfree")
    print(f"  fp32 {logits} batch_size={batch_size}: log-prob {d_lp:.1e}, entropy {d_en:.1e}")


def _loss_and_grads(tr, inputs):
    tr.model.zero_grad(set_to_none=True)
    loss = tr._compute_loss(tr.model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in tr.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_type", ztrl.SUPPORTED_LOSS_TYPES)
@pytest.mark.parametrize("beta,entropy_coef", [(0.0, 0.0), (0.04, 0.01)])
def test_loss_gradients_equal_stock(pair32, loss_type, beta, entropy_coef):
    stock, zorro = pair32
    ids, am, C = _batch(seed=2)
    P = ids.size(1) - C
    m = am[:, P:].bool()
    with torch.no_grad():
        lp, _, _ = stock._get_per_token_logps_and_entropies(stock.model, ids, am, C)
    g = torch.Generator().manual_seed(3)
    # vespo weights each sequence by a function of exp(sum of its token log-ratios): fp32 rounding of the C
    # log-probs adds up there and the exp amplifies it (measured 1.1e-5 rel on the loss at 0.05 noise per token);
    # at 0.01 per token its conditioning is the token-level losses' (ratios still != 1)
    noise = 0.01 if loss_type == "vespo" else 0.05
    inputs = dict(prompt_ids=ids[:, :P], prompt_mask=am[:, :P], completion_ids=ids[:, P:], completion_mask=am[:, P:],
                  advantages=torch.randn(ids.size(0), generator=g), num_items_in_batch=am[:, P:].sum(),
                  old_per_token_logps=(lp + noise * torch.randn(lp.shape, generator=g)) * m,  # ratios != 1, clipping
                  ref_per_token_logps=(lp + 0.1 * torch.randn(lp.shape, generator=g)) * m)
    for tr in (stock, zorro):
        tr.loss_type, tr.beta, tr.entropy_coef = loss_type, beta, entropy_coef
        tr.importance_sampling_level = "sequence" if loss_type == "luspo" else "token"
    L_s, g_s = _loss_and_grads(stock, inputs)
    L_z, g_z = _loss_and_grads(zorro, inputs)
    assert g_s.keys() == g_z.keys() and len(g_s) > 10
    assert L_z.item() == pytest.approx(L_s.item(), rel=1e-5, abs=1e-7)
    rel = max(((g_s[k] - g_z[k]).abs().max() / g_s[k].abs().max().clamp(min=1e-30)).item() for k in g_s)
    assert rel <= 1e-5, rel
    print(f"  {loss_type} beta={beta} entropy_coef={entropy_coef}: loss |d| {abs(L_s - L_z).item():.1e}, "
          f"grad max rel (per tensor) {rel:.1e}")


def test_reference_and_old_logps_are_deduplicated(pair32):
    """The no-grad callers (reference: a separate model here; old log-probs) go through zorro and are counted."""
    stock, zorro = pair32
    ids, am, C = _batch(seed=4)
    zorro._metrics["train"].clear()
    with torch.no_grad():
        ref_z, _, _ = zorro._get_per_token_logps_and_entropies(zorro.ref_model, ids, am, C, batch_size=8)
        ref_s, _, _ = stock._get_per_token_logps_and_entropies(stock.ref_model, ids, am, C, batch_size=8)
    assert (ref_z - ref_s).abs().max().item() <= 1e-5
    assert ztrainer.is_installed(zorro.accelerator.unwrap_model(zorro.ref_model))
    saved = zorro._metrics["train"]["zorro/prompt_tokens_saved"]
    assert len(saved) == 1 and saved[0] > 0 and zorro._metrics["train"]["zorro/fallbacks"] == [0.0]


def test_multimodal_inputs_on_a_text_model_are_refused_by_name(pair32):
    """Images for a text-only model: nothing would encode them (stock fails on the unexpected keyword too)."""
    _, zorro = pair32
    ids, am, C = _batch()
    with pytest.raises(ValueError, match="pixel_values.*with a text-only model"):
        zorro._get_per_token_logps_and_entropies(zorro.model, ids, am, C, pixel_values=torch.zeros(1, 3))


def test_aux_loss_is_refused_by_name(pair32):
    _, zorro = pair32
    ids, am, C = _batch()
    with pytest.raises(ValueError, match="MoE router auxiliary loss"):
        zorro._get_per_token_logps_and_entropies(zorro.model, ids, am, C, compute_aux_loss=True)


def test_warn_runs_stock_and_counts_the_fallback(trl_assets, tmp_path, pair32):
    """A start-time refusal under ``on_unsupported='warn'``: warned once, every call is stock's (bitwise) and
    counted in ``zorro/fallbacks``; zorro is uninstalled for it."""
    stock, _ = pair32
    tr = _trainer(ztrl.ZorroGRPOTrainer, trl_assets, tmp_path, zorro={"on_unsupported": "warn"})
    tr.model.load_state_dict(stock.model.state_dict())
    tr.args.use_liger_kernel = True
    with pytest.warns(UserWarning, match="use_liger_kernel=True"):
        ztrainer._setup(tr, tr._zorro.settings)
    ids, am, C = _batch(seed=5)
    with torch.no_grad():
        lp, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, am, C)
        lp_s, _, _ = stock._get_per_token_logps_and_entropies(stock.model, ids, am, C)
    assert torch.equal(lp, lp_s)
    assert tr._metrics["train"]["zorro/fallbacks"] == [1.0]
    with pytest.raises(ValueError, match="which zorro's packed forward is not tested"):
        ztrainer._setup(tr, ztrl.trl_settings())


def test_version_check():
    ztrl.check_trl_version("raise")  # the installed one is the tested one
    with pytest.raises(ValueError, match=r"trl 1\.17\.0 is not the tested version"):
        ztrl.check_trl_version("raise", version="1.17.0")
    with pytest.warns(UserWarning, match="is not the tested version"):
        ztrl.check_trl_version("warn", version="1.15.2")


def test_settings_are_validated():
    s = ztrl.trl_settings({"logits_optimization": "memory"}, sharing="prefix")
    assert s.enable and s.logits_optimization == "memory" and s.sharing == "prefix"
    assert ztrl.trl_settings().logits_optimization == "memory"  # TRL's head never materialises the logits
    assert ztrl.trl_settings(logits_optimization="none").logits_optimization == "none"
    with pytest.raises(ValueError, match="unknown key"):
        ztrl.trl_settings(rollout_n=4)
    with pytest.raises(ValueError, match="attention_backend"):
        ztrl.trl_settings(attention_backend="nope")


def test_group_keeping_permutation():
    """Rows of a prompt adjacent and in order; groups ordered by their first row in stock's permutation."""
    pm = torch.ones(6, 3, dtype=torch.long)
    pm[1, 0] = pm[4, 0] = 0  # left pad: prompt [0, 7, 8] vs [7, 8] differ only under the mask
    ids = torch.tensor([[1, 2, 3], [0, 7, 8], [1, 2, 3], [5, 7, 8], [9, 7, 8], [1, 2, 3]])
    stock = torch.tensor([3, 4, 0, 5, 1, 2])
    perm = ztrainer.group_keeping_permutation(ids, pm, stock)
    # groups: {0,2,5} prompt 1 2 3; {1,4} prompt 7 8; {3} prompt 5 7 8; first rows in stock: 3, 4, 0
    assert perm.tolist() == [3, 1, 4, 0, 2, 5]


@pytest.mark.parametrize("cfg,match", [
    (dict(loss_type="bnpo"), "its normaliser is per micro-batch"),
    (dict(gradient_accumulation_steps=2, steps_per_generation=4), "would move rows between optimizer steps"),
    (dict(entropy_coef=0.01), "are computed per micro-batch, so regrouping"),
])
def test_group_order_refusals(trl_assets, tmp_path, cfg, match):
    with pytest.raises(ValueError, match=match):
        _trainer(ztrl.ZorroGRPOTrainer, trl_assets, tmp_path, zorro={"micro_batch_order": "groups"}, **cfg)
    with pytest.warns(UserWarning, match=match):  # warn: TRL's own order, zorro still on
        tr = _trainer(ztrl.ZorroGRPOTrainer, trl_assets, tmp_path, zorro={"micro_batch_order": "groups",
                                                                         "on_unsupported": "warn"}, **cfg)
    assert not tr._zorro.group_order and tr._zorro.unsupported is None


def test_bf16_autocast_relative_rule(trl_assets, tmp_path):
    """TRL's default ``bf16=True`` (an fp32 model under bf16 autocast, also on CPU): zorro's log-probs are within the
    project's bf16 relative rule: their relative error against the fp64 ordinary forward is <= 2x stock's."""
    stock = _trainer(GRPOTrainer, trl_assets, tmp_path / "s", bf16=True)
    zorro = _trainer(ztrl.ZorroGRPOTrainer, trl_assets, tmp_path / "z", bf16=True)
    zorro.model.load_state_dict(stock.model.state_dict())
    ids, am, C = _batch(seed=6)
    out, _ = trl_assets
    ref_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    ref_model.load_state_dict({k: v.double() for k, v in stock.model.state_dict().items()})
    ref, _ = _ordinary_fp64(ref_model, ids, am, C, pad_positions=True)
    with torch.no_grad():
        lp_s, _, _ = stock._get_per_token_logps_and_entropies(stock.model, ids, am, C)
        lp_z, _, _ = zorro._get_per_token_logps_and_entropies(zorro.model, ids, am, C)
    m = am[:, -C:].bool()
    err_s = ((lp_s.double() - ref)[m].norm() / ref[m].norm()).item()
    err_z = ((lp_z.double() - ref)[m].norm() / ref[m].norm()).item()
    assert 0 < err_z <= 2 * err_s, (err_z, err_s)
    print(f"  bf16 autocast: relative error vs fp64, zorro {err_z:.2e}, stock {err_s:.2e}")
