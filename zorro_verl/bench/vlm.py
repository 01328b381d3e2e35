"""The vision-language benchmark (``--vlm``): GRPO batches whose prompts hold images, the ordinary padded forward vs
zorro (each unique prompt's images through the vision tower once, each unique prompt once through the language
model), against the FLOP model's ideal with the vision tower counted (docs/design/math.md, model-step.md).

A scenario: ``G`` prompts x ``n`` rollouts (``B = G n`` rows), each prompt ``images`` images of ``image_tokens``
merged tokens (a square grid: 256 = 16 x 16 merged = 32 x 32 patches of 14 pixels, a 448 x 448 image) and
``text_tokens`` text tokens (the two vision markers around each image included), responses of ``R`` tokens. The
rows of a prompt hold the same pixel tensors (verl repeats a prompt's multimodal inputs by reference); siblings are
not adjacent (rows shuffled), and every rotated batch has other images and tokens. The rows' 3-D positions
(the model's ``get_rope_index``) are computed with the batch, outside the timer, as verl's data pipeline does.

Per scenario and mode (``fwd``, ``fwd_bwd``), interleaved run by run:

* ``ordinary`` — the ordinary padded forward ``[B, S]`` of the rows: the rows' pixels concatenated, every row's
  images through the tower, the same response-only log-prob head as the model-level benchmark's ``a2a``;
* ``zorro`` — plan building (:func:`~zorro_verl.packing.multimodal.build_media_plan`: content keys (BLAKE2b of the
  pixels), grouping, packed media and positions) + :func:`~zorro_verl.integrations.transformers.zorro_step`.

Rows: medians, the paired speed-up (median of neighbouring runs' ratios), ``ideal`` (the FLOP model,
:func:`~zorro_verl.bench.flops.vlm_flop_model`), ``efficiency_paired``, images encoded per side (counted by a hook
on the tower in the check run), and ``logprob_max_abs_diff`` (zorro vs ordinary per-token log-probs, first batch).
Also ``plan`` (plan building alone, content keys included), interleaved with the two, for ``plan_ms``.
Targets (:data:`VLM_TARGETS`, on the preset's device): fwd_bwd efficiency >= 0.85 where the ideal is >= 2x; fp32
log-probs equal within 1e-5; where nothing is shared the zorro / ordinary time is reported, not judged.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional

import torch

from zorro_verl.bench.flops import vlm_flop_model
from zorro_verl.bench.report import logprob_check, markdown_table
from zorro_verl.bench.runner import Runner, common_fields, setup_run
from zorro_verl.bench.timing import Clock, time_interleaved

__all__ = ["VlmScenario", "VlmSettings", "VLM_CPU_SCENARIOS", "VLM_GPU_SCENARIOS", "VLM_PRESETS", "VLM_TARGETS",
           "parse_vlm_scenario", "scenario_flops", "vlm_batches", "VlmRunner", "run_vlm_bench", "check_vlm_targets",
           "format_vlm_table"]

#: Text tokens are drawn from ``[1, TEXT_VOCAB)``: below every special id of the VLM shapes.
TEXT_VOCAB = 4000


@dataclass(frozen=True)
class VlmScenario:
    """``B`` rows in ``G`` groups (``n = B / G`` rollouts each); per prompt ``images`` images of ``image_tokens``
    merged tokens (a square number) and ``text_tokens`` text tokens (vision markers included); ``R`` response
    tokens."""

    name: str
    B: int
    G: int
    image_tokens: int
    text_tokens: int
    R: int
    images: int = 1

    @property
    def n(self) -> int:
        return self.B // self.G

    @property
    def P(self) -> int:
        return self.images * self.image_tokens + self.text_tokens

    def side(self) -> int:
        s = math.isqrt(self.image_tokens)
        if s * s != self.image_tokens or s < 1:
            raise ValueError(f"scenario {self.name}: image_tokens {self.image_tokens} is not a square (images are "
                             "square grids of merged tokens).")
        return s

    def check(self) -> None:
        self.side()
        if self.B % self.G or self.G < 1:
            raise ValueError(f"scenario {self.name}: B={self.B} is not a multiple of G={self.G}.")
        if self.text_tokens < 2 * self.images or self.R < 1 or self.images < 1:
            raise ValueError(f"scenario {self.name}: expected images >= 1, text_tokens >= 2 per image (the vision "
                             f"markers) and R >= 1, got images={self.images}, text={self.text_tokens}, R={self.R}.")


#: The CPU set: 2 prompts x 8 rollouts behind one 256-token image (a 448 x 448 picture) + 32 text tokens, R = 32;
#: 4 prompts x 4 rollouts with two 64-token images each; and no sharing at all (4 prompts, one rollout each: zorro
#: pays content keys and packing for nothing; reported, not a target).
VLM_CPU_SCENARIOS = (
    VlmScenario("img256", 16, 2, 256, 32, 32),
    VlmScenario("2img64", 16, 4, 64, 32, 32, images=2),
    VlmScenario("noshare", 4, 4, 256, 32, 32),
)
#: The GPU scenario (issue size, defined for --preset gpu --vlm): 1,024 image tokens (896 x 896) + 64 text, n = 8.
VLM_GPU_SCENARIOS = (VlmScenario("img1024", 16, 2, 1024, 64, 128),)


@dataclass(frozen=True)
class VlmSettings:
    """A ``--vlm`` run's settings: model shape (:data:`~zorro_verl.bench.models.VLM_SHAPES`), dtype name, device,
    clock, CPU threads, gradient checkpointing, scenarios, whether the targets apply."""

    name: str
    device: str
    dtype: str
    model: str
    scenarios: tuple
    clock: str
    threads: int
    grad_ckpt: bool
    targets: bool


VLM_PRESETS = {
    "cpu": VlmSettings("vlm-cpu", "cpu", "float32", "vlm-quick", VLM_CPU_SCENARIOS, "cpu", 1, False, True),
    "gpu": VlmSettings("vlm-gpu", "cuda", "bfloat16", "qwen2.5-vl-3b", VLM_GPU_SCENARIOS, "wall", 1, True, True),
}
#: ``efficiency``: fwd_bwd ``efficiency_paired`` where ``ideal >= min_ideal``; ``logprob_abs``: fp32 per-token
#: log-probs of zorro vs the ordinary forward, max absolute difference. Where nothing is shared (``G == B``) the
#: zorro / ordinary time is reported (``INFO``), not judged: content keys hash every image's pixels (BLAKE2b on the
#: host), a cost the ordinary forward does not pay and that no sharing pays back.
VLM_TARGETS = {"efficiency": 0.85, "min_ideal": 2.0, "logprob_abs": 1e-5}


def parse_vlm_scenario(text: str) -> VlmScenario:
    """A name of :data:`VLM_CPU_SCENARIOS` / :data:`VLM_GPU_SCENARIOS`, or ``B,G,I,T,R[,K]`` (``I`` image tokens
    per image, ``T`` text tokens, ``K`` images per prompt, default 1)."""
    named = {s.name: s for s in VLM_CPU_SCENARIOS + VLM_GPU_SCENARIOS}
    if text in named:
        return named[text]
    parts = text.split(",")
    try:
        vals = [int(p) for p in parts]
    except ValueError:
        vals = []
    if len(vals) not in (5, 6):
        raise ValueError(f"--vlm-scenario: expected one of {sorted(named)} or B,G,I,T,R[,K], got {text!r}.")
    k = vals[5] if len(vals) == 6 else 1
    B, G, i, t, r = vals[:5]
    sc = VlmScenario(f"B{B}G{G}-{k}x{i}+{t}-R{r}", B, G, i, t, r, images=k)
    sc.check()
    return sc


def scenario_flops(cfg, sc: VlmScenario) -> dict:
    """:func:`~zorro_verl.bench.flops.vlm_flop_model` of a scenario from the config alone (every row of the same
    lengths, as :func:`vlm_batches` makes them), without building a model or a batch: e.g. the GPU scenario's ideal
    on Qwen2.5-VL-3B. Adds ``ideal`` (forward) and ``ideal_fwd_bwd``."""
    from zorro_verl.bench.flops import vlm_flop_model

    sc.check()
    side = sc.side() * cfg.vision_config.spatial_merge_size
    grid = [1, side, side]
    f = vlm_flop_model(cfg, torch.full((sc.B,), sc.P), torch.full((sc.B,), sc.R), torch.arange(sc.B) % sc.G,
                       sc.P + sc.R, [grid] * (sc.B * sc.images), [grid] * (sc.G * sc.images))
    return {**f, "ideal": f["baseline"] / f["zorro"], "ideal_fwd_bwd": f["baseline_fwd_bwd"] / f["zorro_fwd_bwd"]}


def vlm_batches(sc: VlmScenario, k: int, model, device: str) -> list[dict]:
    """``k`` batches of one scenario: the same shape, other images / tokens and row orders. Each: ``input_ids``,
    ``attention_mask [B, S]``, ``responses [B, R]``, ``media`` (per row: the dict of its prompt, shared by
    reference within a group: ``pixel_values [K h w, 1176] fp32``, ``image_grid_thw [K, 3]``) and ``positions
    [3, B, S]`` (the model's ``get_rope_index``)."""
    from zorro_verl.integrations.transformers.vision import rope_positions
    from zorro_verl.testing.vlm import VlmRow, vlm_batch

    sc.check()
    cfg = model.config
    v = cfg.vision_config
    m = v.spatial_merge_size
    side = sc.side() * m  # patches a side
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    grid = torch.tensor([[1, side, side]])
    text_per_image = sc.text_tokens - 2 * sc.images  # besides the markers
    out = []
    for i in range(k):
        gen = torch.Generator().manual_seed(1000 + i)
        rnd = lambda n, g=gen: torch.randint(1, TEXT_VOCAB, (n,), generator=g).tolist()  # noqa: E731
        rows = []
        for _ in range(sc.G):
            before = text_per_image // 2
            prompt, pix = rnd(before), []
            for _ in range(sc.images):
                prompt += [cfg.vision_start_token_id] + [cfg.image_token_id] * sc.image_tokens + \
                    [cfg.vision_end_token_id]
                pix.append(torch.randn(side * side, patch_dim, generator=gen))
            prompt += rnd(text_per_image - before)
            media = {"pixel_values": torch.cat(pix).to(device), "image_grid_thw": grid.repeat(sc.images, 1).to(device)}
            rows += [VlmRow(prompt, rnd(sc.R), media) for _ in range(sc.n)]
        perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(i)).tolist()
        b = vlm_batch([rows[j] for j in perm])
        b = {key: (val.to(device) if torch.is_tensor(val) else val) for key, val in b.items()}
        b["positions"] = rope_positions(model, b["input_ids"], b["attention_mask"], b["media"])
        out.append(b)
    return out


class VlmRunner(Runner):
    """The two steps on one vision-language model (attention switches and gradient resets as :class:`Runner`)."""

    def __init__(self, model, grad_ckpt: bool):
        from zorro_verl.integrations.transformers.vision import media_tokens

        super().__init__(model, grad_ckpt, None)
        self.tokens = media_tokens(model)

    def ordinary(self, batch: dict, mode: str, per_token: bool = False) -> torch.Tensor:
        """The ordinary padded forward (every row's images through the tower) with the response-only head; the
        log-prob sum (``per_token``: the log-probs ``[N]``, row-major)."""
        from zorro_verl.logprob import response_logprobs

        m = self.model
        ids, am, media = batch["input_ids"], batch["attention_mask"], batch["media"]
        R = batch["responses"].shape[1]
        Pw = ids.shape[1] - R
        with torch.set_grad_enabled(mode == "fwd_bwd"):
            pix = torch.cat([x["pixel_values"] for x in media])
            grid = torch.cat([x["image_grid_thw"] for x in media])
            hidden = m.model(input_ids=ids, attention_mask=am, position_ids=batch["positions"], pixel_values=pix,
                             image_grid_thw=grid, use_cache=False).last_hidden_state  # [B, S, H]
            valid = am[:, Pw:].bool()
            lp, _ = response_logprobs(hidden[:, Pw - 1:-1][valid], m.get_output_embeddings(), ids[:, Pw:][valid])
            loss = lp.sum()
        if mode == "fwd_bwd":
            loss.backward()
        return lp.detach() if per_token else loss.detach()

    def plan(self, batch: dict):
        from zorro_verl.packing.multimodal import build_media_plan

        return build_media_plan(batch["input_ids"], batch["attention_mask"], batch["responses"].shape[1],
                                batch["media"], self.tokens, batch["positions"])

    def zorro_vlm(self, batch: dict, mode: str, backend: str, per_token: bool = False) -> torch.Tensor:
        """Plan building (content keys included) + zorro's step; the log-prob sum (``per_token``: ``[B, R]``
        padded log-probs)."""
        from zorro_verl.integrations.transformers import zorro_step

        plan, media = self.plan(batch)
        with torch.set_grad_enabled(mode == "fwd_bwd"):
            lp, _ = zorro_step(self.model, plan, backend=backend, media=media)
            loss = lp.sum()
        if mode == "fwd_bwd":
            loss.backward()
        return plan.to_padded(lp.detach()) if per_token else loss.detach()


def _encoded(model, fn) -> tuple:
    """``(fn(), items the vision tower encoded during it)`` (a forward hook on the tower counts grid rows)."""
    seen = []
    h = model.model.visual.register_forward_hook(
        lambda mod, args, kwargs, out: seen.append(int(kwargs.get("grid_thw", args[-1] if args else None).shape[0])),
        with_kwargs=True)
    try:
        out = fn()
    finally:
        h.remove()
    return out, sum(seen)


def run_vlm_bench(scenarios=VLM_CPU_SCENARIOS, *, modes=("fwd", "fwd_bwd"), model_shape="vlm-quick",
                  dtype=torch.float32, device="cpu", warmup=1, reps=5, clock="cpu", backend="sdpa",
                  grad_ckpt=False, log=print) -> list[dict]:
    """Run the grid; one row per (scenario, mode) (see the module docstring for the fields)."""
    from zorro_verl.bench.models import build_vlm_model

    dev, _ = setup_run(reps, device, [backend])
    model = build_vlm_model(model_shape, dtype, device)
    if grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # no dropout in Qwen2.5-VL; train mode as in update_policy
    ck = Clock(clock, dev.type == "cuda")
    runner = VlmRunner(model, grad_ckpt)
    common = common_fields(dev, dtype, model_shape, clock, reps, warmup, grad_ckpt)
    rows = []
    for sc in scenarios:
        batches = vlm_batches(sc, 3, model, device)
        fl: dict = {}
        for i in range(warmup, warmup + reps):  # FLOPs of exactly the batches the timed runs use
            bt = batches[i % len(batches)]
            plan, media = runner.plan(bt)
            f = vlm_flop_model(model.config, plan.row_prompt_lens.cpu(), plan.response_lens.cpu(),
                               plan.row_group.cpu(), bt["input_ids"].shape[1],
                               torch.cat([x["image_grid_thw"] for x in bt["media"]]).cpu(),
                               media.inputs["image_grid_thw"].cpu())
            for key, val in f.items():
                fl[key] = fl.get(key, 0) + val / reps
        # check run (not timed): per-token log-probs of both sides on the first batch, and the items each encodes
        with torch.no_grad():
            runner.use_baseline()
            b0 = batches[0]
            ref, enc_ord = _encoded(model, lambda b=b0: runner.ordinary(b, "fwd", per_token=True))
            runner.use_zorro()
            got, enc_z = _encoded(model, lambda b=b0: runner.zorro_vlm(b, "fwd", backend, per_token=True))
        R = b0["responses"].shape[1]
        valid = b0["attention_mask"][:, -R:].bool()
        lp_diff = float((got[valid].double() - ref.double()).abs().max())
        for mode in modes:
            variants = {"ordinary": (runner.use_baseline, lambda b, m=mode: runner.ordinary(b, m)),
                        "zorro": (runner.use_zorro, lambda b, m=mode: runner.zorro_vlm(b, m, backend)),
                        "plan": (lambda: None, runner.plan)}
            times, peak, method = time_interleaved(variants, batches, warmup, reps, ck, runner.reset, dev)
            med = {k: statistics.median(v) for k, v in times.items()}
            paired = statistics.median(a / z for a, z in zip(times["ordinary"], times["zorro"]))
            fb = "_fwd_bwd" if mode == "fwd_bwd" else ""
            ideal = fl["baseline" + fb] / fl["zorro" + fb]
            row = {"scenario": sc.name, "B": sc.B, "G": sc.G, "n": sc.n, "images_per_prompt": sc.images,
                   "image_tokens": sc.image_tokens, "text_tokens": sc.text_tokens, "P": sc.P, "R": sc.R,
                   "mode": mode, "backend": backend, "ordinary_ms": med["ordinary"], "zorro_ms": med["zorro"],
                   "plan_ms": med["plan"], "plan_fraction": med["plan"] / med["zorro"],
                   "speedup": med["ordinary"] / med["zorro"], "speedup_paired": paired, "ideal_speedup": ideal,
                   "efficiency_paired": paired / ideal,
                   "text_ideal": (fl["baseline" + fb] - fl["vision_baseline" + fb])
                   / (fl["zorro" + fb] - fl["vision_zorro" + fb]),
                   "vision_ideal": fl["vision_baseline" + fb] / fl["vision_zorro" + fb],
                   "vision_flop_share_ordinary": fl["vision_baseline" + fb] / fl["baseline" + fb],
                   "images_ordinary": enc_ord, "images_zorro": enc_z,
                   "images_ordinary_flop_model": round(fl["images_baseline"]),
                   "images_zorro_flop_model": round(fl["images_zorro"]),
                   "ordinary_tokens": round(fl["baseline_tokens"]), "zorro_tokens": round(fl["zorro_tokens"]),
                   "flops_ordinary": fl["baseline" + fb], "flops_zorro": fl["zorro" + fb],
                   "ordinary_peak_mb": peak["ordinary"], "zorro_peak_mb": peak["zorro"], "mem_method": method,
                   "ordinary_runs_ms": times["ordinary"], "zorro_runs_ms": times["zorro"],
                   "plan_runs_ms": times["plan"],
                   "logprob_max_abs_diff": lp_diff, **common}
            rows.append(row)
            log(f"{sc.name:>8} {mode:>7}: ordinary {med['ordinary']:8.1f} ms  zorro {med['zorro']:8.1f} ms  "
                f"x{paired:.2f}  ideal {ideal:.2f}  eff {paired / ideal:.2f}  plan {med['plan']:.1f} ms  "
                f"images {enc_ord}/{enc_z}  "
                f"|dlp| {lp_diff:.1e}")
    return rows


def check_vlm_targets(rows: list[dict], targets: Optional[dict] = None) -> list[str]:
    """``PASS`` / ``FAIL`` lines (:data:`VLM_TARGETS`): fwd_bwd efficiency where the ideal is >= ``min_ideal`` and
    fp32 log-prob equality once per scenario; an ``INFO`` line with the fwd_bwd time ratio where nothing is
    shared."""
    t = targets or VLM_TARGETS
    out, seen = [], set()
    for r in rows:
        if r["mode"] == "fwd_bwd" and r["ideal_speedup"] >= t["min_ideal"]:
            ok = r["efficiency_paired"] >= t["efficiency"]
            out.append(f"{'PASS' if ok else 'FAIL'} {r['scenario']}: efficiency {r['efficiency_paired']:.2f} >= "
                       f"{t['efficiency']} (fwd_bwd, ideal {r['ideal_speedup']:.2f})")
        if r["mode"] == "fwd_bwd" and r["G"] == r["B"]:
            out.append(f"INFO {r['scenario']}: zorro / ordinary time {1 / r['speedup_paired']:.3f} (fwd_bwd, "
                       f"nothing shared; plan building with content keys {r['plan_ms']:.0f} ms = "
                       f"{100 * r['plan_fraction']:.1f} % of zorro's step)")
        if r["dtype"] == str(torch.float32) and r["scenario"] not in seen:
            seen.add(r["scenario"])
            out.append(logprob_check(r, t["logprob_abs"])[1])
    return out


def format_vlm_table(rows: list[dict]) -> str:
    """A markdown table of the rows (the form docs/BENCHMARKS.md quotes)."""
    head = ["scenario", "B", "n", "prompt (image + text)", "R", "mode", "ordinary ms", "zorro ms", "of which plan ms",
            "speedup", "ideal", "efficiency", "images encoded ordinary / zorro"]
    cells = []
    for r in rows:
        img = f"{r['images_per_prompt']}x{r['image_tokens']}" if r["images_per_prompt"] > 1 else str(r["image_tokens"])
        cells.append([r["scenario"], r["B"], r["n"], f"{img} + {r['text_tokens']}", r["R"], r["mode"],
                      f"{r['ordinary_ms']:.0f}", f"{r['zorro_ms']:.0f}", f"{r['plan_ms']:.0f}",
                      f"x{r['speedup_paired']:.2f}", f"{r['ideal_speedup']:.2f}", f"**{r['efficiency_paired']:.2f}**",
                      f"{r['images_ordinary']} / {r['images_zorro']}"])
    return markdown_table(head, cells)
