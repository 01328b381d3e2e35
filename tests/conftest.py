
import pytest
import torch

# Tiny models: one thread is as fast and keeps parallel test processes from oversubscribing the two cores.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (not available on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    import sys

    mod = sys.modules.get("tests.integrations.transformers.test_step")
    if mod is not None and any(mod.WORST.values()):
        worst = ", ".join(f"{k} {v:.2e}" for k, v in mod.WORST.items())
        terminalreporter.write_line(f"zorro vs ordinary (fp64, tiny Qwen3/Qwen3-MoE), worst: {worst}")
    fam = sys.modules.get("tests.integrations.transformers.test_families")
    for kind, vals in (getattr(fam, "WORST", None) or {}).items():
        worst = ", ".join(f"{k} {v:.2e}" for k, v in vals.items())
        terminalreporter.write_line(f"zorro vs ordinary (fp64, tiny {kind}), worst: {worst}")
    allf = sys.modules.get("tests.integrations.transformers.test_all_families")
    if getattr(allf, "WORST", None):
        w = allf.WORST
        worst = {k: max((r[k][0] if k == "grad rel" else r[k]) for r in w.values()) for k in next(iter(w.values()))}
        terminalreporter.write_line(f"zorro vs each family's own per-row forward (fp64, {len(w)} exact families), "
                                    "worst: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    vis = sys.modules.get("tests.integrations.transformers.test_vision")
    for (kind, sharing), vals in (getattr(vis, "WORST", None) or {}).items():
        worst = ", ".join(f"{k} {v:.2e}" for k, v in vals.items())
        terminalreporter.write_line(f"zorro vs ordinary (fp64, tiny {kind} with images, sharing={sharing}), worst: "
                                    f"{worst}")
    resp = sys.modules.get("tests.integrations.transformers.test_vision_responses")
    for (kind, sharing), vals in (getattr(resp, "WORST", None) or {}).items():
        worst = ", ".join(f"{k} {v:.2e}" for k, v in vals.items())
        terminalreporter.write_line(f"zorro vs ordinary (fp64, tiny {kind} with images in responses, "
                                    f"sharing={sharing}), worst: {worst}")
    meg = sys.modules.get("tests.integrations.megatron.test_gpt_step")
    for case, res in (getattr(meg, "WORST", None) or {}).items():
        vals = "" if res["logprob"] is None else f"log-probs {res['logprob']:.2e}, entropy {res['entropy']:.2e}, "
        terminalreporter.write_line(f"zorro vs megatron (fp64, tiny GPTModel) {case}: {vals}gradients "
                                    f"{res['grad_rel']:.2e} (relative)")
    mla = sys.modules.get("tests.integrations.megatron.test_mla")
    for case, res in (getattr(mla, "WORST", None) or {}).items():
        terminalreporter.write_line(f"zorro vs megatron (fp64, tiny MLA GPTModel) {case}: log-probs "
                                    f"{res['logprob']:.2e}, entropy {res['entropy']:.2e}, gradients "
                                    f"{res['grad_rel']:.2e} (relative)")
    mod = sys.modules.get("tests.integrations.verl.v09.test_ulysses")
    for case, line in (getattr(mod, "SUMMARY", None) or {}).items():
        for what, text in line.items():
            terminalreporter.write_line(f"zorro Ulysses {case} {what}: {text}")
