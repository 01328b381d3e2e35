"""One rank of the step-level Ulysses check (tests/integrations/transformers/test_ulysses_step.py): ``zorro_step``
with an :class:`~zorro_verl.packing.ulysses.UlyssesShard` on every rank of an SP group against ``zorro_step`` of the
whole packed row on one rank, no verl involved.

Run as ``python -m tests.support.ulysses_step RANK WORLD INIT_FILE DEVICE SUITE OUT_JSON`` (``DEVICE``: ``cpu`` =
fp64 over gloo with the ``sdpa`` backend; ``cuda`` = bf16 over NCCL with the ``flash`` backend, plus an fp64 ``sdpa``
oracle for the relative rule; ``SUITE``: ``all``, ``base`` (the prompt-plan cases below), ``trees`` (two
prefix-tree cases of :func:`_tree_and_hybrid_cases`, CPU only), ``ssm`` (Mamba-2 models, :func:`_ssm_cases`, CPU
only) or ``vlm`` (vision-language models, :func:`_vlm_cases`, CPU only)). Models: tiny Qwen3s with 4 query / 2 KV
heads and with 2 query / 1 KV head (fewer KV heads than SP ranks when ``WORLD = 2``), on CPU also tiny gpt-oss
(sliding windows, attention sinks) and Gemma 2 (windows, soft-capping); the batch has 3 shuffled prompts, a 1-token
and an empty response and an odd packed length. Loss ``sum(w1 * log_probs) + sum(w2 * entropy)`` with fixed random
weights; the SP gradient is the SP group's sum divided by ``WORLD`` (the row gather scales by SP, as verl's does, for
FSDP's averaging).
"""

from __future__ import annotations

import os

__all__ = ["run_rank"]


def _errors(ref: dict, got: dict) -> dict:
    """Relative errors (Frobenius) of log-probs, entropy and the whole gradient of ``got`` against ``ref``."""
    import torch

    def rel(a, b):
        return ((a.double() - b.double()).norm() / a.double().norm().clamp_min(1e-30)).item()

    ga = torch.cat([g.double().flatten() for g in ref["grads"].values()])
    gb = torch.cat([got["grads"][k].double().flatten() for k in ref["grads"]])
    return {"log_probs": rel(ref["logp"], got["logp"]), "entropy": rel(ref["ent"], got["ent"]), "grads": rel(ga, gb),
            "log_probs_max_abs": (ref["logp"].double() - got["logp"].double()).abs().max().item(),
            "entropy_max_abs": (ref["ent"].double() - got["ent"].double()).abs().max().item()}


def _tree_and_hybrid_cases(rank: int, world: int, step, errors, names=None) -> dict:
    """CPU fp64 cases beyond the prompt plan: a prefix tree (a shared system prompt over three questions, two
    responses sharing their first tokens, an identical row, and verl's multi-output agent-loop samples with tool
    tokens masked out) on tiny Qwen3, and hybrid Qwen3.5 / Qwen3-Next (gated delta-net) with the prompt plan and
    with a tree, OLMo-hybrid (its delta-net layout) and MiniMax (lightning attention: heads exchanged) with the prompt
    plan, LFM2 (short convs: channels exchanged) with the prompt plan and with a tree. Each: SP vs the same plan
    without SP, and SP vs the ordinary per-row forward."""
    import functools

    import torch
    import torch.distributed as dist

    from zorro_verl.integrations.transformers import install_zorro, zorro_step
    from zorro_verl.integrations.transformers.hybrid import linear_attention_modules
    from zorro_verl.packing import build_plan
    from zorro_verl.packing.ulysses import ulysses_shard
    from zorro_verl.recurrent import chunk_gated_delta_rule_ref
    from zorro_verl.testing import (
        batch_from_rows,
        create_dummy_batch,
        multi_turn_rows,
        ordinary_logprobs,
        shared_system_rows,
        tiny_hybrid_model,
        tiny_mixer_model,
        tiny_model,
    )

    rows = shared_system_rows(3, 2, system_len=9, question_len=3, response_len=4, vocab_size=100, seed=1)
    rows[3] = (rows[3][0], rows[2][1][:2] + rows[3][1][2:])  # two responses of question 1 share 2 tokens
    rows.append(rows[0])  # an identical row
    turns, turn_masks = multi_turn_rows(3, first_prompt_len=5, turn_len=3, observation_len=2, vocab_size=100, seed=2)
    masks = [[1] * len(r) for _, r in rows] + turn_masks
    tree_batch = batch_from_rows(rows + turns, response_masks=masks)
    prompt_batch = create_dummy_batch(batch_size=5, num_unique_prompts=2, prompt_len=7, response_len=5, device="cpu",
                                      add_padding=True, vocab_size=128, seed=5, shuffle=True)

    def plan_of(batch, sharing):
        R = batch["responses"].shape[1]
        return build_plan(batch["input_ids"], batch["attention_mask"], R, sharing=sharing,
                          **({"min_shared_len": 1} if sharing == "prefix" else {}))

    def ordinary(model, batch, w1, w2):
        model.zero_grad(set_to_none=True)
        lp, ent = ordinary_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["responses"].shape[1],
                                    temperature=0.7, calculate_entropy=True)
        ((lp.double() * w1).sum() + (ent.double() * w2).sum()).backward()
        return {"logp": lp.detach(), "ent": ent.detach(),
                "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}}

    def per_param(ref, got, floor):
        """max over parameters of max|d| / max|ref|, each floored at ``floor`` x the largest gradient."""
        scale = max(g.abs().max().item() for g in ref["grads"].values())
        return max(((got["grads"][k] - g).abs().max() / g.abs().max().clamp_min(floor * scale)).item()
                   for k, g in ref["grads"].items())

    out = {}
    cases = [("tree_qwen3", "qwen3", {}, tree_batch, "prefix"),
             ("hybrid_qwen3_5", "qwen3_5", {}, prompt_batch, "prompt"),
             ("hybrid_qwen3_next_k1", "qwen3_next", {"linear_k_heads": 1}, prompt_batch, "prompt"),
             ("hybrid_tree_qwen3_5", "qwen3_5", {}, tree_batch, "prefix"),
             ("hybrid_olmo_hybrid", "olmo_hybrid", {}, prompt_batch, "prompt"),
             ("mixer_lfm2", "lfm2", {}, prompt_batch, "prompt"),
             ("mixer_tree_lfm2", "lfm2", {}, tree_batch, "prefix"),
             ("mixer_minimax", "minimax", {}, prompt_batch, "prompt")]
    for name, kind, cfg, batch, sharing in cases:
        if names is not None and name not in names:
            continue
        plan = plan_of(batch, sharing)
        shard = ulysses_shard(plan, world, rank, dist.group.WORLD)
        gen = torch.Generator().manual_seed(3)
        w1, w2 = (torch.randn(plan.N, generator=gen, dtype=torch.float64) for _ in range(2))
        if kind == "qwen3":
            ref_model, model = (tiny_model("qwen3", dtype=torch.float64, seed=0, heads=4) for _ in range(2))
        elif kind in ("olmo_hybrid", "lfm2", "minimax"):  # OLMo-hybrid: its three convs exchanged as one conv
            ref_model, model = (tiny_mixer_model(kind, dtype=torch.float64, seed=1, **cfg) for _ in range(2))
        else:
            ref_model, model = (tiny_hybrid_model(kind, dtype=torch.float64, seed=1, **cfg) for _ in range(2))
        oracle = ordinary(ref_model, batch, w1, w2)
        rechunk = None
        if kind != "qwen3":  # the hybrid rule: the oracle's own sensitivity to the delta rule's chunking
            for _, mod in linear_attention_modules(ref_model):
                mod.chunk_gated_delta_rule = functools.partial(chunk_gated_delta_rule_ref, chunk_size=4)
            rechunk = ordinary(ref_model, batch, w1, w2)
        install_zorro(model)
        res = {"T": plan.T, "N": plan.N, "rows_per_rank": list(shard.row_counts),
               "tree": plan.tree is not None, "Nh": None if plan.head_index is None else plan.head_index.numel()}
        # Falcon-H1 scales its logits (lm_head_multiplier): the chunked head is refused for it by name
        for mode in ("none",) if kind == "falcon_h1" else ("none", "memory"):
            ref = step(model, "sdpa", None, mode, plan=plan, w=(w1, w2))
            got = step(model, "sdpa", shard, mode, plan=plan, w=(w1, w2))
            e = errors(ref, got)
            e_oracle = errors(oracle, got)
            e_oracle["grad_per_param"] = per_param(oracle, got, 1e-6)
            if rechunk is not None:
                e_oracle["rechunk_per_param"] = per_param(oracle, rechunk, 1e-6)
            res[mode] = {"sp_vs_ref": e, "sp_vs_oracle": e_oracle}
        if plan.tree is not None:  # per-row temperatures: outputs sharing a head row divide it by their own
            temps = torch.linspace(0.5, 1.2, plan.B, dtype=torch.float32)
            pair = []
            for sh in (None, shard):
                model.zero_grad(set_to_none=True)
                lp, en = zorro_step(model, plan, backend="sdpa", temperature=temps, calculate_entropy=True, shard=sh)
                ((lp.double() * w1).sum() + (en.double() * w2).sum()).backward()
                grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
                if sh is not None:
                    for g in grads.values():
                        dist.all_reduce(g)
                        g /= world
                pair.append({"logp": lp.detach(), "ent": en.detach(), "grads": grads})
            res["per_row_temperature"] = {"sp_vs_ref": errors(*pair)}
        out[name] = res
    return out


def _ssm_cases(rank: int, world: int, step, errors) -> dict:
    """CPU fp64 Mamba-2 cases (tests/integrations/transformers/test_ssm.py): Bamba with 2 B / C groups (each rank
    takes its heads' group), Mamba2 with 1 group (repeated per head before the exchange), both with the prompt plan,
    and Bamba with a prefix tree; the hybrid layers of Zamba2 and Falcon-H1 (2 groups, prompt plan; Falcon-H1 in
    logits mode none only). Each: SP vs the same plan without SP, and SP vs the ordinary per-row forward."""
    import torch
    import torch.distributed as dist

    from zorro_verl.integrations.transformers import install_zorro
    from zorro_verl.packing import build_plan
    from zorro_verl.packing.ulysses import ulysses_shard
    from zorro_verl.testing import (
        batch_from_rows,
        create_dummy_batch,
        ordinary_logprobs,
        shared_system_rows,
        tiny_ssm_model,
    )

    rows = shared_system_rows(2, 2, system_len=9, question_len=3, response_len=4, vocab_size=100, seed=1)
    rows[3] = (rows[3][0], rows[2][1][:2] + rows[3][1][2:])  # two responses of question 1 share 2 tokens
    tree_batch = batch_from_rows(rows)
    prompt_batch = create_dummy_batch(batch_size=5, num_unique_prompts=2, prompt_len=7, response_len=5, device="cpu",
                                      add_padding=True, vocab_size=128, seed=5, shuffle=True)
    out = {}
    for name, kind, groups, batch, sharing in (("bamba_g2", "bamba", 2, prompt_batch, "prompt"),
                                               ("mamba2_g1", "mamba2", 1, prompt_batch, "prompt"),
                                               ("bamba_tree", "bamba", 2, tree_batch, "prefix"),
                                               ("zamba2_g2", "zamba2", 2, prompt_batch, "prompt"),
                                               ("falcon_h1_g2", "falcon_h1", 2, prompt_batch, "prompt")):
        R = batch["responses"].shape[1]
        plan = build_plan(batch["input_ids"], batch["attention_mask"], R, sharing=sharing,
                          **({"min_shared_len": 1} if sharing == "prefix" else {}))
        shard = ulysses_shard(plan, world, rank, dist.group.WORLD)
        gen = torch.Generator().manual_seed(3)
        w1, w2 = (torch.randn(plan.N, generator=gen, dtype=torch.float64) for _ in range(2))
        ref_model, model = (tiny_ssm_model(kind, dtype=torch.float64, seed=1, groups=groups) for _ in range(2))
        ref_model.zero_grad(set_to_none=True)
        lp, ent = ordinary_logprobs(ref_model, batch["input_ids"], batch["attention_mask"], R, temperature=0.7,
                                    calculate_entropy=True)
        ((lp.double() * w1).sum() + (ent.double() * w2).sum()).backward()
        oracle = {"logp": lp.detach(), "ent": ent.detach(),
                  "grads": {n: p.grad.detach().clone() for n, p in ref_model.named_parameters() if p.grad is not None}}
        install_zorro(model)
        res = {"T": plan.T, "N": plan.N, "tree": plan.tree is not None}
        # Falcon-H1 scales its logits (lm_head_multiplier): the chunked head is refused for it by name
        for mode in ("none",) if kind == "falcon_h1" else ("none", "memory"):
            ref = step(model, "sdpa", None, mode, plan=plan, w=(w1, w2))
            got = step(model, "sdpa", shard, mode, plan=plan, w=(w1, w2))
            e_oracle = errors(oracle, got)
            e_oracle["grad_per_param"] = max(((got["grads"][k] - g).abs().max() / g.abs().max()).item()
                                             for k, g in oracle["grads"].items())
            res[mode] = {"sp_vs_ref": errors(ref, got), "sp_vs_oracle": e_oracle}
        out[name] = res
    return out


def vlm_rows(text_prompt: tuple = (5,)) -> list:
    """A VLM batch of :func:`_vlm_cases` (:class:`~zorro_verl.testing.vlm.VlmRow` s, siblings interleaved): prompts
    A (a 2x3-token image), B (A's tokens, another image of the same size), D (two images, one of them A's) and T
    (``text_prompt``, text); responses with no image, a tool image (4 tokens) in two rows of A's group and one of T's,
    an empty and a 1-token response. Packed rows at SP = 2 (checked by the test): ``(5,)`` with the prompt plan 84
    tokens, ``(5, 6)`` with a prefix tree 81 (odd: padded), each with the two slices meeting inside an image."""
    import torch

    from zorro_verl.testing.vlm import agent_row, image

    a, b, c, tool = image(1, 2, 3), image(2, 2, 3), image(3), image(4)
    prompts = [[[1, 2], a, [3, 4]], [[1, 2], b, [3, 4]], [[1], a, [8], c, [9]], [list(text_prompt)]]
    g = torch.Generator().manual_seed(0)
    rows = []
    for k in range(3):
        for i, p in enumerate(prompts):
            resp = torch.randint(10, 100, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist()
            if (i, k) in ((0, 1), (0, 2), (3, 0)):  # a tool image inside the response
                rows.append(agent_row(p, [resp[:1], tool, resp[1:] + [11]]))
            else:
                rows.append(agent_row(p, [resp]))
    rows[2].response = []  # an empty response (prompt D)
    rows[5].response = [42]  # a 1-token response (prompt B)
    return rows


def _vlm_cases(rank: int, world: int, errors) -> dict:
    """CPU fp64 vision-language cases: Qwen2.5-VL (windowed vision attention), Qwen3-VL (deepstack features sliced
    with the row) and Qwen3.5 (gated delta-net; with the oracle's re-chunking error, the hybrid rule) with the prompt
    plan, Qwen3-VL also with a prefix tree,
    on :func:`vlm_rows` (images in prompts and responses). Each: ``zorro_step`` with media and a shard (every rank the
    whole padded row up to the merged embeddings, the language model its slice) vs the same plan without SP, and vs
    each row alone through the model's own forward; the images the vision tower encoded per rank."""
    import copy
    import functools
    import time

    import torch
    import torch.distributed as dist

    from zorro_verl.integrations.transformers import install_zorro, zorro_step
    from zorro_verl.integrations.transformers.hybrid import linear_attention_modules
    from zorro_verl.integrations.transformers.vision import media_tokens, rope_positions
    from zorro_verl.packing.multimodal import build_media_plan
    from zorro_verl.packing.ulysses import ulysses_shard
    from zorro_verl.recurrent import chunk_gated_delta_rule_ref
    from zorro_verl.testing.vlm import IMAGE, tiny_vlm_model, vlm_batch

    temperature = 0.7

    def oracle(model, rows, R, w1, w2):
        """Each row alone (its media, its positions from get_rope_index): log-probs / entropy ``[B, R]`` and the
        gradient of the weighted sum."""
        model.zero_grad(set_to_none=True)
        lp = torch.zeros(len(rows), R, dtype=torch.float64)
        ent = torch.zeros_like(lp)
        total = 0.0
        for b, r in enumerate(rows):
            ids = torch.tensor([r.prompt + r.response])
            media = r.media or {}
            pos = rope_positions(model, ids, None, [media])
            logits = model(input_ids=ids, position_ids=pos, use_cache=False, **media).logits[0] / temperature
            p, n = len(r.prompt), len(r.response)
            logp = torch.log_softmax(logits[p - 1:p + n - 1], -1)
            row_lp = logp.gather(-1, ids[0, p:p + n, None])[:, 0]
            row_ent = -(logp.exp() * logp).sum(-1)
            total = total + (row_lp * w1[b, :n]).sum() + (row_ent * w2[b, :n]).sum()
            lp[b, :n], ent[b, :n] = row_lp.detach(), row_ent.detach()
        total.backward()
        return {"logp": lp, "ent": ent,
                "grads": {n: q.grad.detach().clone() for n, q in model.named_parameters() if q.grad is not None}}

    def step(model, plan, media, shard, w1, w2):
        model.zero_grad(set_to_none=True)
        logp, ent = zorro_step(model, plan, backend="sdpa", temperature=temperature, calculate_entropy=True,
                               media=media, shard=shard)
        ((logp * plan.from_padded(w1)).sum() + (ent * plan.from_padded(w2)).sum()).backward()
        grads = {n: q.grad.detach().clone() for n, q in model.named_parameters() if q.grad is not None}
        if shard is not None:  # the SP group's partial gradients add up to sp x the gradient (see module doc)
            for g in grads.values():
                dist.all_reduce(g)
                g /= world
        return {"logp": plan.to_padded(logp.detach()), "ent": plan.to_padded(ent.detach()), "grads": grads}

    out = {}
    for name, kind, sharing in (("vlm_qwen2_5_vl", "qwen2_5_vl", "prompt"), ("vlm_qwen3_vl", "qwen3_vl", "prompt"),
                                ("vlm_tree_qwen3_vl", "qwen3_vl", "prefix"), ("vlm_qwen3_5", "qwen3_5", "prompt")):
        t0 = time.perf_counter()
        rows = vlm_rows((5,) if sharing == "prompt" else (5, 6))
        batch = vlm_batch(rows)
        R = batch["responses"].shape[1]
        ref_model = tiny_vlm_model(kind, seed=1)
        model = copy.deepcopy(ref_model)
        install_zorro(model)
        pos = rope_positions(model, batch["input_ids"], batch["attention_mask"], batch["media"])
        plan, media = build_media_plan(batch["input_ids"], batch["attention_mask"], R, batch["media"],
                                       media_tokens(model), pos, sharing=sharing,
                                       **({"min_shared_len": 1} if sharing == "prefix" else {}))
        shard = ulysses_shard(plan, world, rank, dist.group.WORLD)
        gen = torch.Generator().manual_seed(3)
        w1, w2 = (torch.randn(len(rows), R, generator=gen, dtype=torch.float64) for _ in range(2))
        orc = oracle(ref_model, rows, R, w1, w2)
        encoded = []
        model.model.visual.register_forward_hook(
            lambda m, args, kwargs, o, seen=encoded: seen.append(int(kwargs.get("grid_thw", args[-1]).shape[0])),
            with_kwargs=True)
        ref = step(model, plan, media, None, w1, w2)
        encoded.clear()
        got = step(model, plan, media, shard, w1, w2)
        mask = torch.zeros(len(rows), R, dtype=torch.bool)
        for b, r in enumerate(rows):
            mask[b, :len(r.response)] = True
        L = shard.local_len
        ids = plan.input_ids.tolist()
        e_oracle = errors({**orc, "logp": orc["logp"][mask], "ent": orc["ent"][mask]},
                          {**got, "logp": got["logp"][mask], "ent": got["ent"][mask]})
        def per_param(ref, other):
            return max(((other["grads"][k] - g).abs().max() / g.abs().max()).item() for k, g in ref["grads"].items())

        e_oracle["grad_per_param"] = per_param(orc, got)
        if kind == "qwen3_5":  # the hybrid rule: the oracle's own sensitivity to the delta rule's chunking
            for _, mod in linear_attention_modules(ref_model):
                mod.chunk_gated_delta_rule = functools.partial(chunk_gated_delta_rule_ref, chunk_size=4)
            e_oracle["rechunk_per_param"] = per_param(orc, oracle(ref_model, rows, R, w1, w2))
        out[name] = {"T": plan.T, "N": plan.N, "rows_per_rank": list(shard.row_counts), "tree": plan.tree is not None,
                     "items": media.items, "row_items": media.row_items, "response_items": media.response_items,
                     "encoded": sum(encoded),
                     "vision_grads": sum(1 for k in orc["grads"] if ".visual." in k),
                     "boundaries_in_image": sum(1 for s in range(1, world) if ids[s * L - 1] == IMAGE == ids[s * L]),
                     "none": {"sp_vs_ref": errors(ref, got), "sp_vs_oracle": e_oracle},
                     "seconds": time.perf_counter() - t0}
    return out


def run_rank(rank: int, world: int, init_file: str, device: str, suite: str = "all") -> dict:
    os.environ.update(OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    from zorro_verl.integrations.transformers import install_zorro, zorro_step
    from zorro_verl.packing import build_plan
    from zorro_verl.packing.ulysses import ulysses_shard
    from zorro_verl.testing import create_dummy_batch, tiny_model
    from zorro_verl.testing.models import tiny_window_model

    dev = torch.device(device, rank) if cuda else torch.device("cpu")
    b = create_dummy_batch(batch_size=7, num_unique_prompts=3, prompt_len=6, response_len=5, device="cpu",
                           add_padding=True, vocab_size=128, seed=4, shuffle=True)
    plan = build_plan(b["input_ids"].to(dev), b["attention_mask"].to(dev), 5)
    gen = torch.Generator().manual_seed(1)
    w1, w2 = (torch.randn(plan.N, generator=gen, dtype=torch.float64).to(dev) for _ in range(2))
    res = {"T": plan.T, "N": plan.N, "response_lens": sorted(plan.response_lens.tolist())}

    def step(model, backend, shard, mode, plan=plan, w=(w1, w2)):
        model.zero_grad(set_to_none=True)
        logp, ent = zorro_step(model, plan, backend=backend, temperature=0.7, calculate_entropy=True,
                               logits_optimization=mode, chunk_size=3, shard=shard)
        ((logp.double() * w[0]).sum() + (ent.double() * w[1]).sum()).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        if shard is not None:  # the SP group's partial gradients add up to sp x the gradient (see module doc)
            for g in grads.values():
                dist.all_reduce(g)
                g /= world
        return {"logp": logp.detach(), "ent": ent.detach(), "grads": grads}

    if suite == "ssm":
        res.update(_ssm_cases(rank, world, step, _errors))
    if suite == "vlm":
        res.update(_vlm_cases(rank, world, _errors))
    if suite in ("all", "trees"):
        # SP = 4 ("trees") runs the two cases whose exchange differs from SP = 2: the tree with KV heads repeated
        # (2 < 4) and the hybrid tree with the delta-net's key heads repeated (2 < 4)
        res.update(_tree_and_hybrid_cases(rank, world, step, _errors,
                                          None if suite == "all" else ("tree_qwen3", "hybrid_tree_qwen3_5")))
    for heads in ((4, 2) if suite in ("all", "base") else ()):  # (Hq, Hkv) = (4, 2), (2, 1)
        out = {}
        models = {}
        for dtype in ((torch.float64, torch.bfloat16) if cuda else (torch.float64,)):
            m = tiny_model("qwen3", dtype=dtype, seed=0, heads=heads).to(dev)
            install_zorro(m)
            models[dtype] = m
        shard = ulysses_shard(plan, world, rank, dist.group.WORLD)
        out["kv_heads"] = models[torch.float64].config.num_key_value_heads
        out["rows_per_rank"] = list(shard.row_counts)
        for mode in ("none", "memory"):
            if cuda:
                oracle = step(models[torch.float64], "sdpa", None, mode)
                ref = step(models[torch.bfloat16], "flash", None, mode)
                got = step(models[torch.bfloat16], "flash", shard, mode)
                out[mode] = {"ref_vs_oracle": _errors(oracle, ref), "sp_vs_oracle": _errors(oracle, got)}
            else:
                ref = step(models[torch.float64], "sdpa", None, mode)
                got = step(models[torch.float64], "sdpa", shard, mode)
                out[mode] = {"sp_vs_ref": _errors(ref, got)}
        res[f"heads{heads}"] = out
    if not cuda and suite in ("all", "base"):
        # attention features under SP: gpt-oss (sliding windows, per-head sinks, sliced to each rank's heads, with
        # their gradient), Gemma 2 (windows, logit soft-capping; its final-logit soft-cap rules out memory mode) and
        # Llama 4 (chunks of 4 positions; the NoPE query temperature from the rank's slice of the positions)
        from zorro_verl.testing import tiny_llama4_model

        for kind, modes in (("gpt_oss", ("none", "memory")), ("gemma2", ("none",)), ("llama4", ("none",))):
            m = tiny_llama4_model(seed=0) if kind == "llama4" else \
                tiny_window_model(kind, dtype=torch.float64, seed=0, window=4)
            install_zorro(m)
            shard = ulysses_shard(plan, world, rank, dist.group.WORLD)
            res[kind] = {mode: {"sp_vs_ref": _errors(step(m, "sdpa", None, mode), step(m, "sdpa", shard, mode))}
                         for mode in modes}
    dist.barrier()
    dist.destroy_process_group()
    return res


if __name__ == "__main__":
    from tests.support.multi_rank import rank_main

    rank_main(run_rank, str, str)
