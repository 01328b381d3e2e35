"""Peak memory of a training step: zorro's engine (modes none and memory) vs verl 0.9's stock engine, the same
micro-batch, a 32K vocabulary and a response-heavy batch (R >= P). Measured as in scripts/verl_memory.py (one fresh
subprocess per engine, peak RSS delta via /proc/self/clear_refs + VmHWM). zorro's peak must not exceed stock's.
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
