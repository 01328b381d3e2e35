"""TRL GRPO, stock GRPOTrainer vs ZorroGRPOTrainer, on CPU (run in .venv-trl): per phase and a whole training step.

``--what phases``: one TRL-layout micro-batch (G prompts x n completions, left-padded prompts of ~P tokens,
completions up to C), a tiny Qwen3 from a config (fp32), gradient checkpointing on (TRL's default), one thread.
Phases, alternating stock / zorro, median of ``--repeats``: the no-grad log-prob call (old log-probs / reference)
and ``_compute_loss`` + backward (the policy update). The ideal is the token ratio (ordinary tokens / packed tokens).

``--what step``: whole training steps of the real ``GRPOTrainer.train()`` (HF ``generate``, the reward, the
reference model's log-probs with ``beta`` > 0, the loss, backward and the optimizer step), stock vs zorro on the same
model, seed and prompts (the completions are checked identical), on a dataset of distinct ~P-token prompts, G
prompts x n completions per step. ``--blocks`` blocks per side, alternating stock / zorro (each block a fresh
trainer running ``--steps`` steps; its first step is a warm-up and not counted). Per step (a callback from
``on_step_begin`` to ``on_step_end``, this process's CPU time: one thread, so other processes on the host do not
count) the step time and, within it, the time of ``_generate`` (the rollouts); ``train`` = step - generation. Medians
over every counted step. The ideal of the training part is the token ratio of its log-prob forwards (the padded
``[B, P + C]`` tokens stock's forwards compute / the packed tokens zorro's compute, recorded at TRL's seam); the
whole step's ideal keeps the generation time as measured (Amdahl).

``--what both`` (default) runs the phases, then the steps.
Usage: .venv-trl/bin/python scripts/bench_trl.py [--prompt 400 --completion 32 --groups 2 --n 4 --hidden 256]
"""

import argparse
import hashlib
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
    ap.add_argument("--what", choices=("phases", "step", "both"), default="both")
    ap.add_argument("--steps", type=int, default=4, help="--what step: steps per block (the first is a warm-up)")
    ap.add_argument("--blocks", type=int, default=2, help="--what step: blocks per side, alternating")
    ap.add_argument("--beta", type=float, default=0.04, help="--what step: KL coefficient (> 0: a reference model)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.what in ("phases", "both"):
        phases(a)
    if a.what in ("step", "both"):
        whole_step(a)


def phases(a):
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


def long_prompts(tok, count: int, length: int, seed: int = 0) -> list:
    """``count`` distinct conversational prompts of about ``length`` tokens (template included): words of the
    tokenizer's corpus drawn at random, appended until the templated prompt holds ``length`` tokens."""
    from tests.support.trl_assets import _CORPUS

    words = " ".join(_CORPUS).split()
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(count):
        text = f"Question {k}:"
        while True:
            msgs = [{"role": "user", "content": text}]
            n = len(tok(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))["input_ids"])
            if n >= length:
                break
            text += "".join(" " + words[int(i)] for i in torch.randint(len(words), (max(1, (length - n) // 4),),
                                                                         generator=g))
        out.append(msgs)
    return out


class _StepClock:
    """A ``TrainerCallback`` timing each optimizer step (``on_step_begin`` -> ``on_step_end``, this process's CPU
    time and wall time) and, inside it, the trainer's ``_generate`` calls; and the tokens of the log-prob forwards
    (stock's padded ``[B, P + C]`` rows vs zorro's packed row of the same call)."""

    def __init__(self, trainer):
        from transformers import TrainerCallback

        self.steps, self.gen, self.calls, self.completions = [], [], [], []
        clock = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                clock.t0 = (time.process_time(), time.perf_counter())
                clock.gen.append(0.0)
                clock.calls.append([])

            def on_step_end(self, args, state, control, **kw):
                clock.steps.append((time.process_time() - clock.t0[0], time.perf_counter() - clock.t0[1]))

        trainer.add_callback(Callback())
        generate, seam = trainer._generate, trainer._get_per_token_logps_and_entropies

        def timed_generate(*args, **kwargs):
            t = time.process_time()
            out = generate(*args, **kwargs)
            clock.gen[-1] += time.process_time() - t
            clock.completions.append(hashlib.sha256(repr(out[1]).encode()).hexdigest())  # completion ids
            return out

        def counted_seam(model, input_ids, attention_mask, logits_to_keep, batch_size=None, *args, **kwargs):
            clock.calls[-1].append((input_ids, attention_mask, logits_to_keep, batch_size))  # planned after train
            return seam(model, input_ids, attention_mask, logits_to_keep, batch_size, *args, **kwargs)

        trainer._generate = timed_generate
        trainer._get_per_token_logps_and_entropies = counted_seam

    def tokens(self, k: int) -> tuple:
        """``(padded, packed)`` tokens of step ``k``'s log-prob forwards (stock's ``[B, P + C]`` row chunks, zorro's
        packed row of each chunk)."""
        from zorro_verl.packing import build_plan

        padded = packed = 0
        for ids, am, keep, bs in self.calls[k]:
            bs = bs or ids.size(0)
            for s in range(0, ids.size(0), bs):
                padded += ids[s:s + bs].numel()
                packed += build_plan(ids[s:s + bs], am[s:s + bs], keep).T
        return padded, packed


def whole_step(a):
    """``--what step``: the real ``GRPOTrainer.train()``, stock vs zorro, per step (see the module docstring)."""
    from transformers import AutoModelForCausalLM, PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from tests.support.trl_assets import build, length_reward
    from zorro_verl.integrations.trl import ZorroGRPOTrainer

    tmp = Path(tempfile.mkdtemp())
    out, tok = build(tmp / "m", hidden=a.hidden, layers=a.layers)
    from datasets import Dataset

    steps_total = a.steps * a.groups
    data = Dataset.from_dict({"prompt": long_prompts(tok, steps_total, a.prompt)})
    B = a.groups * a.n

    def block(cls, **kw):
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        args = GRPOConfig(output_dir=str(tmp / cls.__name__), per_device_train_batch_size=B, num_generations=a.n,
                          max_completion_length=a.completion, use_cpu=True, report_to="none", bf16=False,
                          beta=a.beta, save_strategy="no", disable_tqdm=True, max_steps=a.steps, seed=0,
                          logging_steps=1, learning_rate=1e-5)
        tr = cls(model=model, reward_funcs=length_reward, args=args, train_dataset=data, processing_class=tok, **kw)
        tr.remove_callback(PrinterCallback)  # the per-step log dicts (kept in log_history)
        clock = _StepClock(tr)
        t = time.perf_counter()
        tr.train()
        return clock, time.perf_counter() - t, tr.state.log_history

    runs = {"stock": [], "zorro": []}
    wall = {"stock": 0.0, "zorro": 0.0}
    logs = {}
    for b in range(a.blocks):
        order = [("stock", GRPOTrainer, {}), ("zorro", ZorroGRPOTrainer, {"zorro": {"logits_optimization": a.logits}})]
        for name, cls, kw in (order if b % 2 == 0 else order[::-1]):
            clock, w, logs[name] = block(cls, **kw)
            runs[name].append(clock)
            wall[name] += w
            print(f"block {b} {name}: {len(clock.steps)} steps in {w:.0f} s wall", flush=True)
    same = all(s.completions == z.completions for s, z in zip(runs["stock"], runs["zorro"]))

    def med(name, key):
        vals = []
        for c in runs[name]:
            for k in range(1, len(c.steps)):  # the block's first step is a warm-up
                step, wall_s = c.steps[k]
                vals.append({"step": step, "gen": c.gen[k], "train": step - c.gen[k], "wall": wall_s}[key])
        return statistics.median(vals)

    t = {n: {k: med(n, k) for k in ("step", "gen", "train", "wall")} for n in runs}
    c = runs["stock"][0]
    counts = [c.tokens(k) for k in range(1, len(c.steps))]
    padded, packed = sum(x for x, _ in counts), sum(y for _, y in counts)
    ideal_train = padded / packed
    ideal_step = t["stock"]["step"] / (t["zorro"]["gen"] + t["stock"]["train"] / ideal_train)
    dedup = [h["zorro/dedup_ratio"] for h in logs["zorro"] if "zorro/dedup_ratio" in h]
    print(f"\nwhole GRPO step: B={B} (G={a.groups} x n={a.n}) per step, prompts ~{a.prompt} tokens, completions <= "
          f"{a.completion}, beta={a.beta} (reference model), Qwen3 hidden {a.hidden} x {a.layers} layers, fp32, "
          f"1 thread, gradient checkpointing on; zorro logits_optimization={a.logits}; {a.blocks} blocks x "
          f"{a.steps - 1} counted steps per side; completions identical: {same}; log-prob forward tokens "
          f"{padded} computed by stock -> {packed} by zorro (ideal of the training part {ideal_train:.2f}x); "
          f"zorro/dedup_ratio (valid tokens) {statistics.median(dedup) if dedup else float('nan'):.2f}; "
          f"wall: stock {wall['stock']:.0f} s, zorro {wall['zorro']:.0f} s")
    print("| part (median per step, CPU s) | stock s | zorro s | speed-up | ideal |\n|---|---|---|---|---|")
    for key, label, ideal in (("step", "whole step (generation included)", f"{ideal_step:.2f}x (Amdahl)"),
                              ("gen", "generation (HF generate)", "1.00x"),
                              ("train", "training part (step - generation)", f"{ideal_train:.2f}x"),
                              ("wall", "whole step, wall clock", "")):
        print(f"| {label} | {t['stock'][key]:.3f} | {t['zorro'][key]:.3f} | "
              f"{t['stock'][key] / t['zorro'][key]:.2f}x | {ideal} |")


if __name__ == "__main__":
    main()
