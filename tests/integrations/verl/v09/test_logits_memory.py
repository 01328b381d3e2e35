"""Logits memory vs verl 0.9's stock path (scripts/verl_memory.py, docs/BENCHMARKS.md).

* Peak memory of a training step: zorro's engine (modes none and memory) vs the stock engine, the same micro-batch,
  a 32K vocabulary and a response-heavy batch (R >= P), fp32. One fresh subprocess per engine, peak RSS delta via
  /proc/self/clear_refs + VmHWM. zorro's peak must not exceed stock's.
* Bytes per logits element of the head in bf16 (the dtype users train in), counted deterministically: the default
  mode's must not exceed stock's.
"""

import importlib.util

import pytest

from tests.support import REPO_ROOT

pytestmark = pytest.mark.usefixtures("verl_cpu")  # skips without verl 0.9


def _script():
    spec = importlib.util.spec_from_file_location("verl_memory", REPO_ROOT / "scripts" / "verl_memory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_training_step_peak_memory_not_above_stock(tmp_path):
    mod = _script()
    try:
        open("/proc/self/clear_refs", "w").close()
    except OSError:
        pytest.skip("/proc/self/clear_refs is not writable: the peak RSS cannot be reset here")
    mod.save_model(str(tmp_path))
    base = dict(ckpt=str(tmp_path), phase="train", batching="micro_batch", micro_batch=4, budget=mod.TOKEN_BUDGET,
                batch=dict(batch_size=4, num_prompts=1, prompt_len=32, response_len=64))
    cfgs = [dict(base, variant=v, chunk=c) for v, c in (("stock", 0), ("none", 1024), ("memory", 32))]
    stock, none, memory = mod.run_configs(cfgs, jobs=2)
    assert stock["logit_rows"] > none["response_rows"] > 32  # several 32-row chunks in the memory mode
    assert stock["peak_bytes"] > 8 * 2**20  # a real measurement (the logits alone are ~50 MiB)
    assert none["peak_bytes"] <= stock["peak_bytes"], (none, stock)
    assert memory["peak_bytes"] <= stock["peak_bytes"], (memory, stock)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_default_mode_bytes_per_logits_element_not_above_stock(temperature):
    """bf16, the dtype users train in: the bytes the default mode (``none``) allocates per logits element beyond the
    logits, counted deterministically (``LiveTensorBytes``: torch's storage sizes, forward and backward), are at most
    stock's — verl's CPU path (its own functions, eager) and the model of its GPU path (flash-attn's cross-entropy +
    the fused entropy: the leanest stock runs). Inference at T = 1 is the one case where stock's GPU path holds
    nothing beyond the logits: there the default's blocks must stay within 1/LEAN_BLOCKS of an 8-byte fp32 pair.
    The earlier default upcast all rows at once: 8 (T = 1) / 10 (T = 0.7) bytes per element, against stock GPU's
    2 (T = 0.7, inference) and 6 (training)."""
    from zorro_verl.logprob import LEAN_BLOCKS

    mod = _script()
    shape = dict(rows=256, vocab=4096, hidden=8, chunk=16, temperature=temperature)
    per_elem = {}
    for path in ("stock_gpu", "stock_cpu", "none"):
        for phase in ("infer", "train"):
            per_elem[path, phase] = mod.head_bytes(path, phase, **shape) / (shape["rows"] * shape["vocab"])
    for phase in ("infer", "train"):
        stock_gpu, stock_cpu, none = (per_elem[p, phase] for p in ("stock_gpu", "stock_cpu", "none"))
        assert none <= stock_cpu, (phase, per_elem)
        if phase == "infer" and temperature == 1.0:
            assert stock_gpu < 0.1 and none <= 8 / LEAN_BLOCKS + 0.01, per_elem
        else:
            assert none <= stock_gpu, (phase, per_elem)
