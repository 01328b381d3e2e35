"""zorro's forward vs OpenRLHF's own ``Actor.forward`` on the real ``openrlhf.models.actor.Actor`` (fp32, CPU).

Each test builds a real ``Actor`` from a tiny Qwen3 checkpoint saved offline (OpenRLHF's loading path), runs the
stock forward and backward of OpenRLHF's PPO loss (``PolicyLoss`` + k3 KL loss + entropy loss, aggregated as in
``ActorPPOTrainer.training_step``), then the same with zorro's forward installed on the class, and compares action
log-probs and entropy (max abs <= 1e-5), the loss and every parameter gradient (relative <= 1e-5). Packed and
padded actors; interleaved siblings, a 1-token and an empty response, a multi-turn response with non-action tokens.
"""

import logging

import pytest
import torch

from tests.integrations.openrlhf.conftest import require_openrlhf_env

require_openrlhf_env()

from openrlhf.models.actor import Actor  # noqa: E402
from openrlhf.models.loss import PolicyLoss, aggregate_loss  # noqa: E402
from openrlhf.models.utils import compute_approx_kl  # noqa: E402

from tests.support.openrlhf_batches import make_samples, pad_batch  # noqa: E402
from zorro_verl.integrations.openrlhf import actor as zactor  # noqa: E402
from zorro_verl.integrations.transformers import is_installed  # noqa: E402
from zorro_verl.integrations.verl.settings import ZorroSettings  # noqa: E402
from zorro_verl.testing.compare import grads_of, max_rel_grad_error  # noqa: E402
from zorro_verl.testing.models import tiny_config  # noqa: E402

TOL = 1e-5
VOCAB = 128


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen3 saved as a local checkpoint (fp32) and its state dict (Actor loads in bf16: restored after)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("qwen3", vocab_size=VOCAB)
    cfg.initializer_range = 0.2  # peaked distributions, so errors show
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path = tmp_path_factory.mktemp("qwen3_tiny")
    model.save_pretrained(path)
    return str(path), {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture
def zorro_class():
    """zorro's forward installed on OpenRLHF's Actor class for one test (restored after)."""
    zactor.install(Actor)
    try:
        yield
    finally:
        zactor.uninstall(Actor)


def make_actor(checkpoint, packing: bool, temperature: float = 0.8, **settings) -> Actor:
    path, state = checkpoint
    actor = Actor(path, attn_implementation="sdpa", param_dtype="bf16", packing_samples=packing,
                  temperature=temperature)
    actor.model.float()
    actor.model.load_state_dict(state)
    actor.train()
    zactor.actor_state(actor, ZorroSettings(enable=True, attention_backend="sdpa", **settings))
    return actor


def ppo_loss(actor, seq, am, act, old, base, adv):
    """OpenRLHF's training-step loss (token-mean PPO + k3 KL loss + entropy bonus), as ActorPPOTrainer composes it."""
    lp, output = actor(seq, act, attention_mask=am, return_output=True, return_entropy=True)
    info = dict(dp_size=1, batch_num_tokens=float(act.sum()))
    actor_loss, *_ = PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28)(lp, old, adv, action_mask=act, **info)
    kl = compute_approx_kl(lp, base, log_probs_old=old, kl_estimator="k3")
    kl_loss = aggregate_loss(kl, act, **info)
    entropy_loss = aggregate_loss(output.entropy[:, -act.shape[1]:], act, **info)
    loss = actor_loss + 0.01 * kl_loss - 0.01 * entropy_loss
    loss.backward()
    return lp.detach(), output.entropy.detach(), loss.detach()


def predicting_positions(am, act):
    """``[B, T-1]`` bool: the positions whose logits predict a response token (zorro computes exactly these)."""
    pos = torch.zeros_like(act, dtype=torch.bool)
    for b in range(act.shape[0]):
        idx = act[b].nonzero().flatten()
        if len(idx):
            pos[b, idx[0]: idx[-1] + 1] = True
    return pos


def compare_training_step(make, seq, am, act, logits: str, ckpt: bool = False) -> dict:
    """OpenRLHF's own forward + PPO loss + backward on ``make()`` (zorro uninstalled) against zorro's on
    ``make(logits_optimization=logits)`` (7-row logits chunks; ``ckpt``: OpenRLHF's gradient checkpointing
    on the zorro actor), same old / reference log-probs and advantages. Returns both actors, their outputs and the
    errors: ``lp_err`` / ``ent_err`` (max abs; entropy at the response-predicting positions), ``loss_err``
    (relative), ``grad_err`` and ``name`` (the worst per-tensor relative gradient error and its parameter)."""
    g = torch.Generator().manual_seed(1)
    B, A = act.shape
    # positive advantages: with zero-mean ones the loss cancels to ~1e-2 of its terms and a relative error of it
    # measures the cancellation, not the forward (the gradients' errors are per tensor either way)
    adv = (torch.rand(B, 1, generator=g) + 0.5).expand(B, A) * act
    zactor.uninstall(Actor)
    stock = make()
    with torch.no_grad():
        base_lp = stock(seq, act, attention_mask=am)
    old = (base_lp + 0.05 * torch.randn(B, A, generator=g)) * act
    base = (base_lp + 0.05 * torch.randn(B, A, generator=g)) * act
    lp0, ent0, loss0 = ppo_loss(stock, seq, am, act, old, base, adv)
    g0 = grads_of(stock.model)
    zactor.install(Actor)
    zorro = make(logits_optimization=logits)
    zactor.actor_state(zorro).logits_chunk_size = 7  # several chunks in the compute / memory modes
    if ckpt:  # OpenRLHF's --actor.gradient_checkpointing_enable (the zorro kwarg survives the recompute)
        zorro.gradient_checkpointing_enable()
    lp1, ent1, loss1 = ppo_loss(zorro, seq, am, act, old, base, adv)
    g1 = grads_of(zorro.model)
    pos = predicting_positions(am, act)
    grad_err, name = max_rel_grad_error(g0, g1)
    return dict(stock=stock, zorro=zorro, lp=(lp0, lp1), ent=(ent0, ent1), pos=pos, g0=g0,
                lp_err=(lp1 - lp0).abs().max().item(), ent_err=(ent1 - ent0)[pos].abs().max().item(),
                loss_err=abs(loss1.item() - loss0.item()) / abs(loss0.item()), grad_err=grad_err, name=name)


def assert_within_tol(r: dict) -> None:
    errs = {k: r[k] for k in ("lp_err", "ent_err", "loss_err", "grad_err")}
    assert all(v <= TOL for v in errs.values()), (errs, r["name"])


@pytest.mark.parametrize("packing,logits,ckpt", [(False, "none", False), (True, "none", False),
                                                 (True, "memory", True), (False, "compute", True)],
                         ids=["padded", "packed", "packed-memory-checkpointing", "padded-compute-checkpointing"])
def test_zorro_forward_matches_openrlhf(checkpoint, zorro_class, packing, logits, ckpt):
    seq, am, act = pad_batch(make_samples(vocab=VOCAB))
    r = compare_training_step(lambda **kw: make_actor(checkpoint, packing, **kw), seq, am, act, logits, ckpt)
    stock, zorro = r["stock"], r["zorro"]
    (lp0, lp1), (ent0, ent1) = r["lp"], r["ent"]
    B, A = act.shape
    assert is_installed(zorro.model) and not is_installed(stock.model)
    assert lp1.shape == lp0.shape == (B, A) and lp1.dtype == lp0.dtype == torch.float32
    assert ent1.shape == ent0.shape == (B, seq.shape[1] - 1)
    assert (ent1[~r["pos"]] == 0).all()  # positions zorro does not compute (OpenRLHF reads entropy under action_mask)
    print(f"\n[openrlhf {'packed' if packing else 'padded'} logits={logits} ckpt={ckpt}] logp max abs "
          f"{r['lp_err']:.2e}, entropy max abs {r['ent_err']:.2e}, loss rel {r['loss_err']:.2e}, grad rel max "
          f"{r['grad_err']:.2e} ({r['name']})")
    assert_within_tol(r)
    m = zactor.pop_metrics(zorro)
    assert m["zorro/dedup_ratio"] > 1.0 and m["zorro/fallback_batches"] == 0.0
    assert m["zorro/prompt_tokens_saved"] > 0


def test_old_and_reference_logprob_calls(checkpoint, zorro_class):
    """The experience maker's calls (``PolicyModelActor.forward`` / ``ReferenceModelActor.forward``: no_grad, eval,
    positional ``(sequences, action_mask, attention_mask)``) return OpenRLHF's masked ``[B, A]`` log-probs."""
    seq, am, act = pad_batch(make_samples(vocab=VOCAB, seed=3))
    zactor.uninstall(Actor)
    stock = make_actor(checkpoint, True).eval()
    with torch.no_grad():
        ref = stock(seq, act, am)
    zactor.install(Actor)
    zorro = make_actor(checkpoint, True).eval()
    with torch.no_grad():
        got = zorro(seq, act, am, ring_attn_group=None)
    assert got.shape == ref.shape and (got - ref).abs().max().item() <= TOL
    assert (got[act == 0] == 0).all()


class EngineLike(torch.nn.Module):
    """Holds the model as its ``module`` child and has a ``config`` of its own, as DeepSpeed's engine does after
    ``strategy.prepare`` (``Actor.model = engine``); its forward calls the module (and counts the calls)."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.config = {"zero_optimization": {"stage": 3}}  # DeepSpeed's engine.config: its DeepSpeed config
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.module(*args, **kwargs)


def test_wrapped_model_runs_through_the_wrapper(checkpoint, zorro_class):
    """With ``Actor.model`` wrapped like a DeepSpeed engine, zorro installs on the Hugging Face model inside, runs
    the forward through the wrapper and returns the stock log-probs."""
    seq, am, act = pad_batch(make_samples(vocab=VOCAB, seed=5))
    zactor.uninstall(Actor)
    with torch.no_grad():
        ref = make_actor(checkpoint, True)(seq, act, am)
    zactor.install(Actor)
    actor = make_actor(checkpoint, True)
    actor.model = EngineLike(actor.model)
    with torch.no_grad():
        got = actor(seq, act, am)
    assert actor.model.calls == 1 and is_installed(actor.model.module)
    assert zactor.hf_model(actor.model) is actor.model.module
    assert (got - ref).abs().max().item() <= TOL


def test_unsupported_calls_raise(checkpoint, zorro_class):
    seq, am, act = pad_batch(make_samples(vocab=VOCAB))
    actor = make_actor(checkpoint, False)
    with pytest.raises(ValueError, match="ring attention"):
        actor(seq, act, am, ring_attn_group=object())
    with pytest.raises(ValueError, match="multimodal inputs"):
        actor(seq, act, am, pixel_values=torch.zeros(1))
    with pytest.raises(ValueError, match="without action_mask"):
        actor(seq, None, am, return_output=True)
    with pytest.raises(ValueError, match="unset ZORRO_OPENRLHF"):
        actor(seq, None, am, return_output=True)


def test_vlm_refused_at_first_call(checkpoint, zorro_class, monkeypatch):
    """Settings from the environment (the switch), the static check at the first call."""
    monkeypatch.setenv("ZORRO_OPENRLHF", "1")
    monkeypatch.setenv("ZORRO_OPENRLHF_OPTIONS", "attention_backend=sdpa")
    seq, am, act = pad_batch(make_samples(vocab=VOCAB))
    path, state = checkpoint
    actor = Actor(path, attn_implementation="sdpa", param_dtype="bf16")
    actor.is_vlm = True
    with pytest.raises(ValueError, match="vision-language"):
        actor(seq, act, am)  # the state (and its static check) is made at the first call


def test_warn_runs_stock_forward_and_counts(checkpoint, zorro_class, caplog):
    """``on_unsupported=warn``: a call zorro cannot serve runs OpenRLHF's stock forward (with the model's own
    attention), warns once per reason and counts every such call; zorro's attention is back afterwards."""
    seq, am, act = pad_batch(make_samples(vocab=VOCAB))
    actor = make_actor(checkpoint, False, on_unsupported="warn")
    with torch.no_grad():
        actor(seq, act, am)  # a zorro call: installs zorro's attention
        assert is_installed(actor.model)
        with caplog.at_level(logging.WARNING):
            out1 = actor(seq, None, am, return_output=True)
            out2 = actor(seq, None, am, return_output=True)
        zactor.uninstall(Actor)
        ref = make_actor(checkpoint, False)(seq, None, am, return_output=True)
        zactor.install(Actor)
    assert torch.equal(out1["logits"], ref["logits"]) and torch.equal(out2["logits"], ref["logits"])
    assert sum("unsupported setting" in r.getMessage() for r in caplog.records) == 1
    assert is_installed(actor.model)
    assert zactor.pop_metrics(actor)["zorro/fallback_batches"] == 2.0


def test_output_has_no_logits_and_refuses_moe_aux_loss():
    out = zactor.ZorroActorOutput(entropy=None, moe=True)
    with pytest.raises(ValueError, match="aux_loss_coef 0"):
        _ = out.aux_loss
    with pytest.raises(AttributeError, match="no logits"):
        _ = out.logits
    assert not hasattr(zactor.ZorroActorOutput(entropy=None, moe=False), "aux_loss")  # dense models: as stock


def make_lora_actor(checkpoint, packing: bool, targets="all-linear", dropout: float = 0.0, **settings) -> Actor:
    """A real LoRA ``Actor`` (``--ds.lora.rank 8``: OpenRLHF wraps its model with PEFT), fp32, the checkpoint's base
    weights restored, and the adapter drawn from a fixed seed (OpenRLHF's own init leaves ``lora_B = 0``)."""
    path, state = checkpoint
    actor = Actor(path, attn_implementation="sdpa", param_dtype="bf16", packing_samples=packing, temperature=0.8,
                  lora_rank=8, lora_alpha=16, target_modules=targets, lora_dropout=dropout)
    actor.model.float()
    base = actor.model.get_base_model()
    missing, unexpected = base.load_state_dict(
        {k: state[k.replace(".base_layer", "")] for k in base.state_dict() if "lora_" not in k}, strict=False)
    assert not unexpected and all("lora_" in k for k in missing)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in actor.model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * (0.1 if "lora_A" in name else 0.05))
    actor.train()
    zactor.actor_state(actor, ZorroSettings(enable=True, attention_backend="sdpa", **settings))
    return actor


@pytest.mark.parametrize("packing,logits,targets", [(False, "none", "all-linear"), (True, "memory", "all-linear"),
                                                    (True, "compute", ["q_proj", "v_proj", "down_proj"])],
                         ids=["padded", "packed-memory", "packed-compute-subset"])
def test_lora_actor_matches_openrlhf(checkpoint, zorro_class, packing, logits, targets):
    """LoRA: log-probs, entropy, the PPO loss and the gradient of every LoRA parameter (the base weights get none)
    as OpenRLHF's own forward of the same PEFT model."""
    seq, am, act = pad_batch(make_samples(vocab=VOCAB, seed=7))
    r = compare_training_step(lambda **kw: make_lora_actor(checkpoint, packing, targets, **kw), seq, am, act, logits)
    g0 = r["g0"]
    assert is_installed(r["zorro"].model)
    assert g0 and all("lora_" in k for k in g0) and len([k for k in g0 if "lora_A" in k]) >= 2
    assert_within_tol(r)
    assert zactor.pop_metrics(r["zorro"])["zorro/fallback_batches"] == 0.0


def test_lora_dropout_refused(checkpoint, zorro_class):
    """``--ds.lora.dropout 0.1``: refused when the actor's zorro state is made (its static check)."""
    with pytest.raises(ValueError, match=r"LoRA dropout > 0 .*p=0.1.*set lora_dropout=0"):
        make_lora_actor(checkpoint, True, dropout=0.1)
