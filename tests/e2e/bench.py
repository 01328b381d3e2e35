"""The e2e speed benchmark: verl's ``python -m verl.trainer.main_ppo`` GRPO runs, stock vs zorro on identical
rollouts, phase by phase (run by scripts/bench_e2e.sh; the GPU sibling is scripts/gpu_e2e.sh --bench).

Runs (each a subprocess of the real entry point, V1 trainer, one training worker, FSDP1 = verl's default strategy,
bf16 compute with fp32 master weights (fp32 compute and fewer layers on a CPU without bf16 units: size_for_cpu),
reference model + KL loss, dynamic batch size, 2 mini-batches per step, on the
benchmark assets of tests/e2e/assets.py: 16 prompts per step, each one ~320-token shared system instruction + a
question, ``rollout.n`` = 8, responses up to 64 tokens; :data:`CPU`, or :func:`gpu_setup` with ``--gpu``):

* ``stock``        — ``zorro.enable=false`` (verl's own engine); records every response vLLM returns;
* ``zorro``        — the preset (``sharing: prompt``), replaying the stock run's responses (without generating:
  the stock run's ``gen`` time of each step stands in for the replay's, in ``gen`` and in the whole ``step``,
  :func:`zorro_verl.bench.e2e.with_stock_generation`);
* ``zorro_prefix`` — the preset with ``sharing: prefix`` (the tree also shares the system instruction across
  questions), replaying the same responses (not in ``--quick``, the CI version: :data:`QUICK_RUNS`).

With ``--critic`` every run is PPO with a critic (``algorithm.adv_estimator=gae``; the value model from the same
checkpoint, FSDP1, the actor's dtypes, mini-batches and micro-batch budget): the table adds the critic's phases,
``values`` and ``update_critic``, with their ideal (the value model: one output per token) and efficiency.

From each run's console log it reads verl's ``timing_s/*`` per step; the first ``--warmup`` steps are dropped and
the medians of the rest are compared phase by phase (:mod:`zorro_verl.bench.e2e`) against the FLOP model's ideal for
the phase's batch (every row's tokens from the recording), with the targets of :data:`zorro_verl.bench.e2e.TARGETS`.
Prints the table, writes ``report.json``, ``report.md`` and ``phases.svg`` under ``--out``; exits 1 when a run
fails or a target is missed.

    python -m tests.e2e.bench [--quick] [--critic] [--steps 4] [--warmup 1] [--out DIR]
                              [--runs stock,zorro,zorro_prefix]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tests.e2e.assets import BENCH_MODEL, BENCH_SYSTEM_TOKENS, build_bench_assets
from tests.e2e.runner import (
    REPO_ROOT,
    base_overrides,
    critic_overrides,
    fallback_metrics,
    micro_batch_overrides,
    process_role,
    run_main_ppo,
    set_override,
)
from tests.support.heap_peak import HEAP_DIR_ENV, read_peaks

N = 8  # rollout.n
RUNS = {
    "stock": dict(zorro=False, rollouts="record"),
    # replay: every response from the stock run's recording, without asking vLLM (its answer would be discarded);
    # the analysis puts the stock run's generation of each step in place of the replay's (with_stock_generation)
    "zorro": dict(zorro=True, sharing="prompt", rollouts="replay"),
    "zorro_prefix": dict(zorro=True, sharing="prefix", rollouts="replay"),
}


#: the CI version's runs: the default sharing only. One main_ppo run fewer in a stage that runs alone at the end of
#: scripts/test.sh; sharing=prefix's step is measured by the full run, its numbers checked by the e2e LoRA pair
QUICK_RUNS = ("stock", "zorro")


@dataclass(frozen=True)
class Setup:
    """The batch and machine of a benchmark: ``prompts`` per step (``train_batch_size``), ``mini`` prompts per
    mini-batch, ``system_tokens`` of shared instruction, responses up to ``response``, ``max_tokens`` per micro-batch
    (dynamic batch size), the model's dimensions (``dims``; vocab: the tokenizer's 512) and the stock attention."""

    name: str
    prompts: int
    mini: int
    system_tokens: int
    response: int
    max_tokens: int
    dims: dict
    attn: str
    gpu: bool = False
    compute: str = "bf16"  # the training worker's compute dtype (verl's mixed_precision.param_dtype)
    critic: bool = False  # PPO with a critic (GAE): the critic's phases too


#: Qwen/Qwen3-0.6B and -1.7B's dimensions (config.json) with the benchmark tokenizer's vocabulary.
QWEN3 = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, max_position_embeddings=8192),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, max_position_embeddings=8192),
}
CPU = Setup("cpu", prompts=16, mini=8, system_tokens=BENCH_SYSTEM_TOKENS, response=64, max_tokens=8192,
            dims=BENCH_MODEL, attn="cpu_varlen")
#: The full CPU run's decoder layers (the CI version keeps BENCH_MODEL's 8): verl's fixed cost per phase (Ray
#: dispatch, the transfer queue: ~0.5 s on 2 cores) is the same for both runs, so the phases' efficiency measures
#: zorro only once the model's compute dwarfs it (docs/BENCHMARKS.md, "Where the time goes").
FULL_LAYERS = 24
#: bf16 matmul GFLOP/s of the 2-core Xeon the runs' layers (24, the CI version 8) were sized on (its bf16 forward ran
#: the model's matmuls at ~600 GFLOP/s, docs/BENCHMARKS.md). A CPU without bf16 units computes in fp32 and gets
#: ``layers * fp32 rate / REF_RATE`` of them, so that a step takes about as long there and verl's fixed
#: cost per phase weighs the same against the compute.
REF_RATE = 600.0
#: ... but at least this many: with one layer the worker's peak is that layer's transient buffers (zorro's reference
#: attention gathers each response's prompt keys; stock's per-row kernel copies nothing), not the per-layer
#: activations a deep model keeps, which is what the memory target compares.
MIN_LAYERS = 2


def gpu_setup(model: str) -> Setup:
    """One H200: 16 prompts x 8 of ~2K-token instruction + question, responses <= 256, flash-attn varlen."""
    return Setup(model, prompts=16, mini=8, system_tokens=2048, response=256, max_tokens=32768, dims=QWEN3[model],
                 attn="flash_attention_2", gpu=True)


def overrides(name: str, assets: dict, work: Path, steps: int, setup: Setup = CPU,
              strategy: str = "fsdp") -> list[str]:
    """Hydra overrides of run ``name`` (:data:`RUNS`) on ``setup``."""
    spec = RUNS[name]
    o = base_overrides(assets, out_dir=work / name, steps=steps, n=N, dtype="fp32", param_dtype=setup.compute,
                       strategy=strategy, lr=1e-5)
    if setup.gpu:
        o += ["trainer.n_gpus_per_node=1", "trainer.nnodes=1", "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
              "transfer_queue.backend.SimpleStorage.num_data_storage_units=1"]
    else:
        from tests.support.verl_cpu_e2e import cpu_overrides

        o += cpu_overrides(1)
    o += micro_batch_overrides(dynamic=True, max_tokens=setup.max_tokens)
    max_prompt = max(assets["prompt_lengths"]) + 64
    for k, v in {"data.train_batch_size": setup.prompts, "data.max_prompt_length": max_prompt,
                 "data.max_response_length": setup.response, "actor_rollout_ref.actor.ppo_mini_batch_size": setup.mini,
                 "actor_rollout_ref.rollout.max_model_len": max_prompt + setup.response,
                 # every prompt's prefill in one engine step: vLLM 0.27's CPU sampler cannot rewind a seeded
                 # request's generator when a chunked prefill discards a sampled token ("CPU Generator does not use
                 # offset")
                 "actor_rollout_ref.rollout.max_num_batched_tokens": setup.prompts * N * (max_prompt + setup.response),
                 "actor_rollout_ref.rollout.max_num_seqs": setup.prompts * N, "trainer.use_v1": True,
                 "+actor_rollout_ref.model.override_config.attn_implementation": setup.attn,
                 # verl's defaults where the e2e tests need other values (their rollout-vs-actor checks, an entropy
                 # term): no rollout log-probs, no entropy bonus
                 "actor_rollout_ref.rollout.calculate_log_probs": False,
                 "actor_rollout_ref.actor.entropy_coeff": 0.0,
                 # verl's default (the e2e tests switch it off): the update recomputes each layer's activations
                 "actor_rollout_ref.model.enable_gradient_checkpointing": True}.items():
        set_override(o, k, v)
    if setup.critic:  # the critic as the actor: fp32 weights, the same compute dtype, mini-batches, micro-batch budget
        for item in critic_overrides(assets, param_dtype=setup.compute, strategy=strategy, optimizer="AdamW", lr=1e-5,
                                     mini=setup.mini, max_tokens=setup.max_tokens, gradient_checkpointing=True):
            set_override(o, *item.split("=", 1))
        set_override(o, "+critic.model.override_config.attn_implementation", setup.attn)
    if not spec["zorro"]:  # the critic follows the actor's switch (the preset)
        o.append("actor_rollout_ref.actor.fsdp_config.zorro.enable=false")
    else:
        o.append(f"actor_rollout_ref.actor.fsdp_config.zorro.sharing={spec['sharing']}")
    return o


def worker_heap_peak(heap_dir: Path):
    """The largest peak heap in use of a training-worker process of one run (GiB; None when not measured:
    no glibc ``mallinfo2``), from :mod:`tests.support.heap_peak`'s files."""
    peaks = [b for cmd, b in read_peaks(heap_dir).values() if process_role(cmd) == "train worker" and b >= 0]
    return max(peaks) / 2**30 if peaks else None


def analyse(results: dict, work: Path, assets: dict, setup: Setup, *, warmup: int,
            targets: dict, heap: dict | None = None) -> tuple[dict, list[str]]:
    """Phase tables of every zorro run against ``stock`` (``{run: rows}``) and the missed targets; the memory target
    on the training worker's peak heap in use (``heap``: run -> GiB) when measured, else on its peak RSS."""
    from transformers import AutoConfig

    from zorro_verl.bench import e2e

    cfg = AutoConfig.from_pretrained(assets["model"])
    steps = [st for st in e2e.read_recording(work / "rollouts.jsonl", setup.prompts) if st.step > warmup]
    stock = results["stock"]
    tables, missed = {}, []
    for name, r in results.items():
        if name == "stock":
            continue
        # the runs use the preset's min_shared_len, phase_ideals' default
        ideals = e2e.phase_ideals(cfg, steps, sharing=RUNS[name]["sharing"], mini_batch=setup.mini,
                                  critic_mini_batch=setup.mini if setup.critic else None)
        zsteps = e2e.with_stock_generation(stock.steps, r.steps) if RUNS[name]["rollouts"] == "replay" else r.steps
        rows = e2e.phase_table(stock.steps, zsteps, ideals, warmup=warmup, targets=targets,
                               unchecked=targets.get("unchecked", {}).get(RUNS[name]["sharing"], ()))
        tables[name] = rows
        if heap:
            mem = (heap["stock"], heap[name], "peak heap in use")
        else:
            mem = (stock.role_peak_gb.get("train worker"), r.role_peak_gb.get("train worker"), "peak RSS")
        missed += [f"{name}: {m}" for m in e2e.check_targets(rows, *mem)]
    return tables, missed


def size_for_cpu(setup: Setup, compute: str, quick: bool, layers: int | None, threads: int) -> Setup:
    """The CPU setup with its compute dtype (``auto``: bf16 where this CPU's bf16 matmul is at least as fast as its
    fp32 one, else fp32 — a CPU without bf16 units runs bf16 several times slower, and no one trains in it there)
    and layers (``layers``, else 24, the CI version 8 — fewer on an fp32 fallback, see :data:`REF_RATE`)."""
    from zorro_verl.bench.e2e import matmul_rate

    n = layers or (BENCH_MODEL["num_hidden_layers"] if quick else FULL_LAYERS)
    if compute == "auto":
        bf16, fp32 = matmul_rate(torch.bfloat16, threads), matmul_rate(torch.float32, threads)
        compute = "bf16" if bf16 >= fp32 else "fp32"
        print(f"[bench-e2e] matmul on this CPU: bf16 {bf16:.0f} GFLOP/s, fp32 {fp32:.0f} GFLOP/s -> {compute} compute"
              + ("" if compute == "bf16" else " (no native bf16 here)"), flush=True)
        if compute == "fp32" and not layers:
            full = n
            n = max(MIN_LAYERS, min(n, round(n * fp32 / REF_RATE)))
            print(f"[bench-e2e] sized to this CPU: {n} layers ({full} at {REF_RATE:.0f} GFLOP/s)", flush=True)
    return replace(setup, compute=compute, dims={**setup.dims, "num_hidden_layers": n})


def command_line(a: argparse.Namespace) -> str:
    """The command that reproduces a run: the script and the arguments that change what is measured."""
    if a.gpu:
        return f"bash scripts/gpu_e2e.sh --bench {a.gpu}"
    args = "".join(flag for flag, on in ((" --quick", a.quick), (" --critic", a.critic),
                                         (f" --layers {a.layers}", a.layers),
                                         (f" --compute {a.compute}", a.compute != "auto"),
                                         (f" --steps {a.steps}", a.steps), (f" --warmup {a.warmup}", a.warmup != 1),
                                         (f" --runs {a.runs}", a.runs))
                   if on)
    return "bash scripts/bench_e2e.sh" + args


def run_names(a: argparse.Namespace) -> list[str]:
    """The runs to make, in order: ``--runs``, else every run (``--quick``: :data:`QUICK_RUNS`)."""
    return [r for r in (a.runs or ",".join(QUICK_RUNS if a.quick else RUNS)).split(",") if r]


def parser() -> argparse.ArgumentParser:
    """The command line of :func:`main`."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="work dir (default: a new temporary one)")
    ap.add_argument("--quick", action="store_true",
                    help="the CI version: stock and zorro (sharing=prompt), 2 measured steps, efficiency bound 0.6")
    ap.add_argument("--critic", action="store_true",
                    help="PPO with a critic (GAE): also the critic's phases, values and update_critic")
    ap.add_argument("--steps", type=int, default=None, help="measured steps after --warmup (default 4, --quick 2)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--runs", default=None,
                    help=f"comma-separated, stock first (default: {','.join(RUNS)}; --quick: {','.join(QUICK_RUNS)})")
    ap.add_argument("--threads", type=int, default=2, help="CPU: OMP threads of every process (the machine's cores)")
    ap.add_argument("--layers", type=int, default=None,
                    help=f"CPU: the model's decoder layers (default {FULL_LAYERS}, --quick "
                         f"{BENCH_MODEL['num_hidden_layers']})")
    ap.add_argument("--compute", choices=["auto", "bf16", "fp32"], default="auto",
                    help="CPU: the training worker's compute dtype (auto: bf16 unless this CPU's bf16 matmul is "
                         "slower than its fp32 one; then fp32, with fewer layers unless --layers is given)")
    ap.add_argument("--timeout", type=int, default=2400, help="time limit of one run, seconds")
    ap.add_argument("--docs", action="store_true", help="write the table and plot into docs/BENCHMARKS.md")
    ap.add_argument("--gpu", choices=sorted(QWEN3), default=None,
                    help="run on one CUDA GPU with this model's dimensions (scripts/gpu_e2e.sh --bench)")
    return ap


def describe(setup: Setup, assets: dict, steps: int, warmup: int) -> str:
    d = setup.dims
    where = ("1 GPU, stock attention flash-attn varlen" if setup.gpu else
             "stock attention: per-row causal sdpa (cpu_varlen, flash varlen's CPU equivalent), stock log-probs "
             "block-wise (flash cross-entropy's CPU equivalent)")
    return (f"verl 0.9.1 main_ppo, V1 trainer, 1 training worker (FSDP1, fp32 weights, "
            f"{setup.compute} compute); "
            f"{setup.prompts} prompts x n={N} per step, prompts {min(assets['prompt_lengths'])}-"
            f"{max(assets['prompt_lengths'])} tokens (one shared system instruction + a question), responses <= "
            f"{setup.response} tokens, {setup.prompts // setup.mini} mini-batches per step, dynamic batch size "
            f"{setup.max_tokens} tokens per micro-batch, gradient checkpointing, reference model + KL loss"
            f"{', a critic (GAE; the value model as the actor, FSDP1)' if setup.critic else ''}; "
            f"model Qwen3 "
            f"{d['num_hidden_layers']} layers x hidden {d['hidden_size']} ({d['num_attention_heads']} heads x "
            f"{d['head_dim']}, {d['num_key_value_heads']} KV heads), vocab 512; {where}; {warmup} warm-up + "
            f"{steps} measured steps")


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    from tests.e2e.gpu_pair import gpu_env
    from tests.support.verl_cpu_e2e import (
        POLL_INTERVAL_ENV,
        ROLLOUT_FILE_ENV,
        ROLLOUT_MODE_ENV,
        STOCK_KERNELS_ENV,
        e2e_env,
    )
    from zorro_verl.bench import e2e
    from zorro_verl.bench.report import git_sha

    setup = replace(gpu_setup(a.gpu) if a.gpu else CPU, critic=a.critic)
    if not a.gpu:
        setup = size_for_cpu(setup, a.compute, a.quick, a.layers, a.threads)
    elif a.layers:
        raise SystemExit("--layers: the GPU runs use the named model's dimensions; drop --layers or --gpu")
    steps = a.steps or (2 if a.quick else 4)
    targets = e2e.QUICK_TARGETS if a.quick else e2e.TARGETS
    names = run_names(a)
    if not names or names[0] != "stock" or any(n not in RUNS for n in names):
        raise SystemExit(f"--runs: expected stock first (it records the rollouts the others replay), then any of "
                         f"{list(RUNS)[1:]}, got {names}")
    work = Path(a.out or tempfile.mkdtemp(prefix="zorro_bench_e2e_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    assets = build_bench_assets(work / "assets", dtype="bfloat16" if setup.compute == "bf16" else "float32",
                                system_tokens=setup.system_tokens,
                                dims=setup.dims)
    rec = work / "rollouts.jsonl"
    results, failed, heap = {}, [], {}
    for name in names:
        # GPU: the record/replay without the CPU platform or the CPU stand-ins (flash-attn is real there)
        env = (gpu_env("tests.support.verl_gpu_bench_plugin") if setup.gpu else
               {**e2e_env(a.threads), STOCK_KERNELS_ENV: "1"})
        mode = RUNS[name]["rollouts"]
        if mode == "record" and rec.exists():
            rec.unlink()
        env.update({ROLLOUT_MODE_ENV: mode, ROLLOUT_FILE_ENV: str(rec), POLL_INTERVAL_ENV: "0.05",
                    HEAP_DIR_ENV: str(work / f"{name}.heap")})
        r = run_main_ppo(name, overrides(name, assets, work, a.warmup + steps, setup), work=work, env=env,
                         python=sys.executable, timeout_s=a.timeout)
        heap[name] = worker_heap_peak(work / f"{name}.heap")
        print(f"[bench-e2e] {name}: rc={r.returncode} {r.seconds:.0f}s steps={sorted(r.steps)} "
              f"peak {r.peak_rss_gb:.1f} GiB (process tree)"
              + ("" if heap[name] is None else f", training worker heap in use {heap[name]:.3f} GiB"), flush=True)
        (work / f"{name}.steps.json").write_text(json.dumps(
            {"steps": r.steps, "roles": r.role_peak_gb, "heap_gb": heap[name], "rc": r.returncode,
             "seconds": r.seconds}, indent=1))
        if r.returncode != 0 or sorted(r.steps) != list(range(1, a.warmup + steps + 1)):
            failed.append(f"{name}: rc={r.returncode}, steps {sorted(r.steps)} ({r.log_path}):\n{r.tail(40)}")
        results[name] = r
    if failed:
        print("\n".join(failed))
        return 1
    if len(results) < 2:
        print(f"[bench-e2e] only {list(results)} ran: nothing to compare (logs in {work})")
        return 0
    heap = heap if all(v is not None for v in heap.values()) else None  # measured in every run, or not used
    tables, missed = analyse(results, work, assets, setup, warmup=a.warmup, targets=targets, heap=heap)
    for name, r in results.items():
        if name != "stock":
            bad = [k for m in r.steps.values() for k, v in fallback_metrics(m).items() if v]
            if bad:
                missed.append(f"{name}: zorro fell back to the stock path ({sorted(set(bad))})")
    where = e2e.machine(gpu=setup.gpu)
    meta = {"command": command_line(a),
            "machine": where, "git sha": git_sha(), "settings": describe(setup, assets, steps, a.warmup),
            "targets": (f"{'actor and critic' if setup.critic else 'actor'} phases with ideal >= "
                        f"{targets['min_ideal']}x: efficiency >= {targets['efficiency']}; "
                        "step: >= Amdahl's law with those phase floors; training worker "
                        + ("peak heap in use" if heap else "peak RSS (no glibc mallinfo2 here)") + ": zorro <= stock"
                        + "".join(f"; sharing={k}: {', '.join(v)} reported, not checked (a known gap, "
                                  "docs/BENCHMARKS.md)" for k, v in targets.get("unchecked", {}).items()))}
    roles = {n: r.role_peak_gb for n, r in results.items()}
    md = e2e.format_markdown(tables, roles, meta, heap)
    (work / "report.md").write_text(md)
    (work / "report.json").write_text(json.dumps({"tables": tables, "meta": meta, "missed": missed,
                                                  "roles": roles, "heap_gb": heap}, indent=1))
    e2e.svg_plot(tables, work / "phases.svg", title=f"verl main_ppo GRPO step, stock vs zorro ({where})")
    print(md)
    if a.docs:
        e2e.write_docs_section(REPO_ROOT / "docs" / "BENCHMARKS.md", md, REPO_ROOT / "docs" / "bench_e2e.svg",
                               work / "phases.svg")
        print("[bench-e2e] wrote docs/BENCHMARKS.md and docs/bench_e2e.svg")
    print("\n" + ("TARGETS MISSED:\n  " + "\n  ".join(missed) if missed else "[bench-e2e] all targets hold"))
    print(f"[bench-e2e] logs, report.md, report.json, phases.svg in {work}")
    return 1 if missed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
