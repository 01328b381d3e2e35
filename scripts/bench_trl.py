"""TRL GRPO step phases, stock GRPOTrainer vs ZorroGRPOTrainer, on CPU (run in .venv-trl).

One TRL-layout micro-batch (G prompts x n completions, left-padded prompts of ~P tokens, completions up to C), a
tiny Qwen3 from a config (fp32), gradient checkpointing on (TRL's default), one thread. Phases, alternating stock /
zorro, median of ``--repeats``: the no-grad log-prob call (old log-probs / reference) and ``_compute_loss`` +
backward (the policy update). The ideal is the token ratio (ordinary tokens / packed tokens).
Usage: .venv-trl/bin/python scripts/bench_trl.py [--prompt 400 --completion 32 --groups 2 --n 4 --hidden 256]
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tests.support.trl_assets import build, dataset, length_reward


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=400)
    ap.add_argument("--completion", type=int, default=32)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--logits", default="memory", help="zorro's logits_optimization (TRL's default here: memory)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from zorro_verl.integrations.trl import ZorroGRPOTrainer
    from zorro_verl.packing import build_plan

    tmp = Path(tempfile.mkdtemp())
    out, tok = build(tmp / "m", hidden=a.hidden, layers=a.layers)
    B = a.groups * a.n

    def trainer(cls, **kw):
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        args = GRPOConfig(output_dir=str(tmp / cls.__name__), per_device_train_batch_size=B, num_generations=a.n,
                          max_completion_length=a.completion, use_cpu=True, report_to="none", bf16=False,
                          beta=0.0, save_strategy="no", disable_tqdm=True)
        tr = cls(model=model, reward_funcs=length_reward, args=args, train_dataset=dataset(4), processing_class=tok,
                 **kw)
        tr.current_gradient_accumulation_steps = 1
        tr.model.train()
        return tr

    stock, zorro = trainer(GRPOTrainer), trainer(ZorroGRPOTrainer, zorro={"logits_optimization": a.logits})
    zorro.model.load_state_dict(stock.model.state_dict())
    g = torch.Generator().manual_seed(0)
    P, C = a.prompt, a.completion
    ids, am = [], []
    for k in range(a.groups):
        p = P - 7 * k
        pr = torch.randint(5, 512, (p,), generator=g)
        for _ in range(a.n):
            c = int(torch.randint(C // 2, C + 1, (), generator=g))
            ids.append(torch.cat([torch.full((P - p,), 3), pr, torch.randint(5, 512, (c,), generator=g),
                                  torch.full((C - c,), 3)]))
            am.append(torch.cat([torch.zeros(P - p), torch.ones(p + c), torch.zeros(C - c)]).long())
    ids, am = torch.stack(ids), torch.stack(am)
    plan = build_plan(ids, am, C)
    inputs = dict(prompt_ids=ids[:, :P], prompt_mask=am[:, :P], completion_ids=ids[:, P:], completion_mask=am[:, P:],
                  advantages=torch.randn(B, generator=g), num_items_in_batch=am[:, P:].sum(),
                  old_per_token_logps=None)

    def nograd(tr):
        with torch.no_grad():
            tr._get_per_token_logps_and_entropies(tr.model, ids, am, C, batch_size=B)

    def update(tr):
        tr.model.zero_grad(set_to_none=True)
        tr._compute_loss(tr.model, inputs).backward()

    times = {}
    for phase, fn in (("log-probs (no grad: old / reference)", nograd), ("policy loss forward+backward", update)):
        for tr in (stock, zorro):
            fn(tr)  # warm-up
        ts = {"stock": [], "zorro": []}
        for _ in range(a.repeats):
            for name, tr in (("stock", stock), ("zorro", zorro)):
                t = time.perf_counter()
                fn(tr)
                ts[name].append(time.perf_counter() - t)
        times[phase] = {k: statistics.median(v) for k, v in ts.items()}
    ideal = plan.ordinary_tokens / plan.T
    print(f"B={B} (G={a.groups} x n={a.n}), P~{P}, C={C}, Qwen3 hidden {a.hidden} x {a.layers} layers, fp32, 1 thread; "
          f"zorro logits_optimization={a.logits}; tokens {plan.ordinary_tokens} ordinary -> {plan.T} packed "
          f"(ideal {ideal:.2f}x)")
    print("| phase | stock s | zorro s | speed-up | ideal (tokens) |\n|---|---|---|---|---|")
    for phase, t in times.items():
        print(f"| {phase} | {t['stock']:.3f} | {t['zorro']:.3f} | {t['stock'] / t['zorro']:.2f}x | {ideal:.2f}x |")


if __name__ == "__main__":
    main()
