"""LoRA (PEFT) in the zorro FSDP engine vs verl 0.9.1's stock engine with the same LoRA config, on CPU (fp32, 1-rank
gloo, FSDP2 and FSDP1 = verl's default ``strategy: fsdp``).

Both engines load the same saved adapter (``model.lora_adapter_path``; its ``lora_B`` drawn at random, so that the
adapter changes the outputs and ``lora_A`` has gradients from the first step), on ``all-linear`` and on a subset of
projections; a fresh adapter (verl's own initialisation, ``lora_B = 0``) runs two steps. Checked: the inference pass
(old log-probs, entropy), the reference pass as verl runs it for LoRA (the actor under ``disable_adapter()``, equal
to the base model without LoRA), and optimizer steps (loss, grad norm, the gradient of every LoRA parameter; the
base weights get none), in logits modes none / compute / memory, sharing prompt and prefix, fixed and dynamic batch
size. Two ranks: tests/support/verl_two_ranks.py. Refused: LoRA dropout > 0 (the deduplicated forward would draw
one dropout mask where the ordinary forward draws one per row) and the memory mode with a LoRA-wrapped LM head.

Tolerances as the engine suite (docs/design/testing.md, fp32): log-probs / entropy max abs <= 1e-5; loss, grad norm and
gradients relative <= 1e-5 (every LoRA parameter's own gradient too, against its own largest entry).
"""

import pytest
import torch

from tests.support.lora import LORA_TARGETS
from tests.support.verl_engines import infer, output_values

pytestmark = pytest.mark.usefixtures("verl_cpu")  # skips without verl 0.9

ATOL = 1e-5
RTOL = 1e-5
PREFIX = {"sharing": "prefix", "min_shared_len": 4}
#: (logits mode, sharing) of the training comparisons
MODES = [("none", "prompt"), ("compute", "prompt"), ("memory", "prompt"), ("none", "prefix"), ("memory", "prefix")]


@pytest.fixture(scope="module")
def adapters(tiny_ckpt, tmp_path_factory):
    """A saved adapter per target set of :data:`LORA_TARGETS`."""
    from tests.support.verl_engines import lora_adapter

    root = tmp_path_factory.mktemp("lora")
    return {name: lora_adapter(tiny_ckpt, root / name, targets, seed=3) for name, targets in LORA_TARGETS.items()}


def _lora(adapters, target):
    from tests.support.verl_engines import lora_model

    return lora_model(adapters[target], LORA_TARGETS[target])


def _batch(**kw):
    """Three questions behind one 10-token system prompt, 3 samples each, shuffled: prompt groups for
    ``sharing=prompt`` and a prefix tree for ``sharing=prefix``."""
    from tests.support.verl_engines import make_engine_batch
    from zorro_verl.testing import batch_from_rows, shared_system_rows

    rows = shared_system_rows(3, 3, system_len=10, question_len=3, response_len=5, vocab_size=100, seed=kw.pop("seed"))
    order = [4, 0, 8, 2, 7, 5, 1, 3, 6]
    base = batch_from_rows([rows[i] for i in order], include_training_fields=True, seed=9)
    return make_engine_batch(base=base, temperature=0.8, calculate_entropy=True, micro_batch_size=3,
                             max_token_len=60, **kw)


@pytest.fixture(scope="module", params=list(LORA_TARGETS))
def target(request):
    return request.param


@pytest.fixture(scope="module")
def infer_engines(verl_cpu, tiny_ckpt, adapters, strategy, target):
    from tests.support.verl_engines import build_engine

    return tuple(build_engine(tiny_ckpt, zorro=z, strategy=strategy, model_overrides=_lora(adapters, target),
                              micro_batch_size=3, max_token_len=60) for z in (False, True))


@pytest.fixture(scope="module")
def base_engine(verl_cpu, tiny_ckpt, strategy):
    """The stock engine without LoRA: the reference policy of a LoRA run."""
    from tests.support.verl_engines import build_engine

    return build_engine(tiny_ckpt, zorro=False, strategy=strategy, micro_batch_size=3, max_token_len=60)


def _max_abs(a, b, td, key):
    mask = td["response_mask"].bool()
    va, vb = output_values(a, td, key), output_values(b, td, key)
    return (va - vb)[mask].abs().max().item(), va[mask].abs().max().item()


@pytest.mark.parametrize("dynamic", [False, True])
def test_infer_and_reference_match_stock(infer_engines, base_engine, dynamic):
    """Old log-probs with the adapter, and the reference with it disabled (verl's ``ref_in_actor``), as stock."""
    stock, zorro = infer_engines
    td = _batch(seed=1, use_dynamic_bsz=dynamic)
    a, b = infer(stock, td), infer(zorro, td)
    for key in ("log_probs", "entropy"):
        err, scale = _max_abs(a, b, td, key)
        assert scale > 0.1 and err <= ATOL, (key, err)
    assert b["metrics"]["zorro/dedup_ratio"][0] > 1.5 and b["metrics"]["zorro/fallback_batches"] == [0.0]
    with stock.disable_adapter():
        ra = infer(stock, td)
    with zorro.disable_adapter():
        rb = infer(zorro, td)
    err, _ = _max_abs(ra, rb, td, "log_probs")
    assert err <= ATOL
    assert rb["metrics"]["zorro/fallback_batches"] == [0.0]
    # the adapter matters, and disabling it gives the base model's values
    assert _max_abs(a, ra, td, "log_probs")[0] > 1e-3
    assert _max_abs(ra, infer(base_engine, td), td, "log_probs")[0] <= ATOL


@pytest.fixture(scope="module")
def stock_steps(verl_cpu, tiny_ckpt, adapters, strategy):
    """The stock engine's two SGD steps on the all-linear adapter (fixed micro-batches, then dynamic)."""
    from tests.support.verl_engines import STEPS_OPTIM, build_engine, run_steps

    batches = [_batch(seed=11), _batch(seed=12, use_dynamic_bsz=True)]
    eng = build_engine(tiny_ckpt, zorro=False, strategy=strategy, model_overrides=_lora(adapters, "all-linear"),
                       micro_batch_size=3, max_token_len=60, optim_overrides=STEPS_OPTIM)
    return batches, run_steps(eng, batches)


def _assert_lora_grads(ref_steps, got_steps):
    """Only LoRA parameters get gradients (the base weights are frozen; under FSDP1 their units report zeros), and
    each one's gradient matches the reference's relative to its own largest entry."""
    from zorro_verl.testing import max_rel_grad_error

    for ra, rb in zip(ref_steps, got_steps):
        ga, gb = ({k: v for k, v in r["grads"].items() if "lora_" in k} for r in (ra, rb))
        assert len(ga) >= 4 and ga.keys() == gb.keys()
        assert all(v.abs().max() == 0 for k, v in rb["grads"].items() if "lora_" not in k)
        worst, name = max_rel_grad_error(ga, gb)
        assert worst <= RTOL, (name, worst)
        assert all(v.abs().max() > 0 for v in ga.values())  # lora_A too (B is not 0)


@pytest.mark.parametrize("mode,sharing", MODES)
def test_training_steps_match_stock(verl_cpu, tiny_ckpt, adapters, strategy, stock_steps, mode, sharing):
    from tests.support.verl_engines import (
        STEPS_OPTIM,
        assert_steps_match,
        build_engine,
        run_steps,
        step_errors,
    )

    batches, ref = stock_steps
    settings = {"logits_optimization": mode, **(PREFIX if sharing == "prefix" else {})}
    # FSDP1: verl's LoRA wrap policy (each LoRA module its own unit) runs only without a size-based policy, so the
    # head stays in the root unit here (the memory mode gathers it with the root)
    eng = build_engine(tiny_ckpt, zorro=True, strategy=strategy, model_overrides=_lora(adapters, "all-linear"),
                       micro_batch_size=3, max_token_len=60, optim_overrides=STEPS_OPTIM, zorro_settings=settings)
    eng.logits_chunk_size = 4
    got = run_steps(eng, batches)
    assert_steps_match(step_errors(ref, got, batches), ATOL, RTOL)
    _assert_lora_grads(ref, got)
    if sharing == "prefix":
        assert got[0]["inf"]["metrics"]["zorro/tree_depth"][0] >= 2  # system prompt -> question -> responses


def test_fresh_adapter_two_steps(verl_cpu, tiny_ckpt, strategy):
    """verl's own initialisation (``lora_B = 0``, no adapter path) on a subset of projections: step 1 trains B only
    (A's gradient is exactly 0 in both engines), step 2 both."""
    from tests.support.verl_engines import (
        STEPS_OPTIM,
        assert_steps_match,
        build_engine,
        lora_model,
        run_steps,
        step_errors,
    )

    batches = [_batch(seed=21), _batch(seed=22)]
    runs = []
    for z in (False, True):
        torch.manual_seed(0)  # PEFT draws lora_A from the global generator: the same adapter in both engines
        runs.append(run_steps(build_engine(tiny_ckpt, zorro=z, strategy=strategy, micro_batch_size=3,
                                           max_token_len=60, model_overrides=lora_model(None, LORA_TARGETS["subset"]),
                                           optim_overrides=STEPS_OPTIM), batches))
    assert_steps_match(step_errors(runs[0], runs[1], batches), ATOL, RTOL)
    for run in runs:
        a1 = [v for k, v in run[0]["grads"].items() if "lora_A" in k]
        a2 = [v for k, v in run[1]["grads"].items() if "lora_A" in k]
        assert a1 and all(v.abs().max() == 0 for v in a1) and all(v.abs().max() > 0 for v in a2)
    _assert_lora_grads(runs[0][1:], runs[1][1:])


def test_lora_dropout_is_refused(verl_cpu, tiny_ckpt, tmp_path):
    from tests.support.verl_engines import build_engine, lora_adapter, lora_model

    path = lora_adapter(tiny_ckpt, tmp_path / "dropout", dropout=0.1)
    with pytest.raises(ValueError, match=r"LoRA dropout > 0 .*p=0.1.*set lora_dropout=0"):
        build_engine(tiny_ckpt, zorro=True, model_overrides=lora_model(path))
    # on_unsupported=warn: every batch runs the stock forward, counted
    eng = build_engine(tiny_ckpt, zorro=True, model_overrides=lora_model(path),
                       zorro_settings={"on_unsupported": "warn"})
    assert infer(eng, _batch(seed=2))["metrics"]["zorro/fallback_batches"] == [1.0]


def test_lora_on_the_lm_head(verl_cpu, tiny_ckpt, tmp_path):
    """A LoRA-wrapped LM head (FSDP1: verl's FSDP2 wrapping cannot shard a LoRA head, stock or not): exact in the
    logits modes that call the head (none), refused in memory mode, which computes the head from its weight alone."""
    from tests.support.verl_engines import build_engine, lora_adapter, lora_model

    targets = ["q_proj", "lm_head"]
    path = lora_adapter(tiny_ckpt, tmp_path / "head", targets, seed=4)
    stock, zorro = (build_engine(tiny_ckpt, zorro=z, model_overrides=lora_model(path, targets), micro_batch_size=3,
                                 strategy="fsdp") for z in (False, True))
    td = _batch(seed=5)
    err, scale = _max_abs(infer(stock, td), infer(zorro, td), td, "log_probs")
    assert scale > 0.1 and err <= ATOL
    with pytest.raises(ValueError, match="logits_optimization=memory with this model's head"):
        build_engine(tiny_ckpt, zorro=True, model_overrides=lora_model(path, targets), strategy="fsdp",
                     zorro_settings={"logits_optimization": "memory"})
