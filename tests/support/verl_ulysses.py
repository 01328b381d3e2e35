"""One rank of the Ulysses sequence-parallel engine check (tests/integrations/verl/v09/test_ulysses.py): gloo with a
``file://`` rendezvous, the CPU platform, fp32 FSDP over all ``sp * dp`` ranks; everything below runs under FSDP2 and
again under FSDP1 (``strategy: fsdp``) in the same processes, results keyed by strategy.

Run as ``python -m tests.support.verl_ulysses RANK WORLD INIT_FILE CKPT SP OUT_JSON``. The ranks of one SP group
hold the same batch (DP rank ``d = RANK // SP`` gets seed ``3 + d``: 12 rows of 3 shuffled prompts, uneven lengths
with a 1-token and an empty response; fixed micro-batches of 3 rows, so 4-row groups are split). Three engines run
inference (log-probs, entropy) and one training step (loss, grad norm, every gradient) on it:

* ``stock_sp``: verl's stock engine with the same SP. verl's Ulysses attention is its patched flash-attention path
  (all-to-all, KV repeat, position-id all-gather, varlen boundaries from position resets); on CPU the one
  flash-attn kernel call inside it is replaced by a plain-torch varlen stand-in (:func:`install_cpu_varlen`);
* ``stock``: verl's stock engine without SP (``sdpa``; all ``WORLD`` ranks are DP ranks, SP-group peers hold the
  same batch, so it computes the same global step);
* ``zorro_sp``: the zorro engine with the same SP (in the single-group run also with ``logits_optimization=memory``
  and gradient checkpointing, and with verl's fused kernels).

Each also runs the inference pass with a dynamic token budget.

``torch.distributed.all_to_all`` is wrapped to count the bytes each engine hands it per training step. Results
(errors against both stock engines, bytes, tokens; the refusals under FSDP2 only, they do not depend on the strategy)
go to ``OUT_JSON``.
"""

from __future__ import annotations

import os

__all__ = ["run_rank", "install_cpu_varlen", "CPU_VARLEN_ATTN"]

#: The attention implementation name the stock SP engine runs under on CPU (no "flash" in it: transformers would
#: then require flash-attn).
CPU_VARLEN_ATTN = "cpu_varlen"


def _cpu_varlen_kernel(query, key, value, attention_mask, query_length, *args, position_ids=None, is_causal=True,
                       softmax_scale=None, **kwargs):
    """Stand-in for transformers' ``_flash_attention_forward`` on CPU, with flash-attn's packed-sequence rule:
    sequences start where ``position_ids == 0``; causal inside each. ``q [1, S, H, D]``, ``k/v [1, S, Hk, D]`` ->
    ``[1, S, H, D]``."""
    import torch

    assert attention_mask is None and position_ids is not None and query.shape[0] == 1
    seg = torch.cumsum((position_ids[0] == 0).long(), 0)  # [S]
    S = seg.numel()
    causal = torch.ones(S, S, dtype=torch.bool).tril() if is_causal else torch.ones(S, S, dtype=torch.bool)
    mask = (seg[:, None] == seg[None, :]) & causal
    rep = query.shape[2] // key.shape[2]
    q, k, v = (x.transpose(1, 2) for x in (query, key.repeat_interleave(rep, 2), value.repeat_interleave(rep, 2)))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=softmax_scale)
    return out.transpose(1, 2)


def install_cpu_varlen() -> None:
    """Register :data:`CPU_VARLEN_ATTN` as transformers' flash-attention integration (so verl's Ulysses patch of
    ``_flash_attention_forward`` wraps it) and put :func:`_cpu_varlen_kernel` where verl's Ulysses wrapper calls
    the flash-attn kernel function."""
    from transformers import AttentionInterface
    from transformers.integrations import flash_attention
    from verl.models.transformers import monkey_patch

    def cpu_varlen_attention(*args, **kwargs):
        return flash_attention.flash_attention_forward(*args, **kwargs)

    AttentionInterface.register(CPU_VARLEN_ATTN, cpu_varlen_attention)
    monkey_patch._flash_attention_forward = _cpu_varlen_kernel


#: Per-GPU token budget of the dynamic-batch-size inference pass (x sp per SP group: several micro-batches).
DYN_BUDGET = 16
#: The same for the agentic batch, whose longest row (18 tokens) must fit the stock engine's per-GPU budget.
TREE_DYN_BUDGET = 24
#: verl's fused kernels, torch backend (the model config's flag; verl's worker copies it into the engine config).
FUSED_MODEL = {"use_fused_kernels": True, "fused_kernel_options": {"impl_backend": "torch"}}


class _A2ACounter:
    """Wraps ``torch.distributed.all_to_all``; counts the bytes of the tensors this rank hands it."""

    def __init__(self):
        import torch.distributed as dist

        self.bytes = 0
        self._orig = dist.all_to_all

        def counted(output_list, input_list, *args, **kwargs):
            self.bytes += sum(t.numel() * t.element_size() for t in input_list)
            return self._orig(output_list, input_list, *args, **kwargs)

        dist.all_to_all = counted


def run_rank(rank: int, world: int, init_file: str, ckpt: str, sp: int) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      VERL_ENGINE_DEVICE="cpu", OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from tests.support.verl_cpu_platform import use_cpu_platform

    use_cpu_platform()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    install_cpu_varlen()
    counter = _A2ACounter()

    import verl.workers.engine  # noqa: F401  (registers the zorro engine before its module is imported here)
    from verl.utils import tensordict_utils as tu

    from tests.support.verl_engines import (
        STRATEGIES,
        build_engine,
        engine_grads,
        make_engine_batch,
        ppo_loss_fn,
        response_values,
    )
    from zorro_verl.integrations.verl.v09.batching import row_lengths

    dp = world // sp
    mbs = 3
    td = make_engine_batch(batch_size=12, num_prompts=3, prompt_len=7, response_len=6, seed=3 + rank // sp,
                           shuffle=True, temperature=0.8, micro_batch_size=mbs, global_batch_size=12 * dp)
    mask = td["response_mask"].bool()
    p, r = row_lengths(td)

    def run(engine, batch=td, budget=DYN_BUDGET):
        # the same rows also with a dynamic token budget (per GPU; verl and zorro: budget * sp per SP group)
        dyn = batch.clone()
        tu.assign_non_tensor(dyn, use_dynamic_bsz=True, max_token_len_per_gpu=budget)
        with engine.eval_mode():
            inf = engine.infer_batch(batch.clone(), loss_function=None)
            inf_dyn = engine.infer_batch(dyn, loss_function=None)
        dyn_mbs = getattr(engine, "zorro_last_micro_batches", None)
        counter.bytes = 0
        with engine.train_mode(zero_grad_on_exit=False):  # keep the grads for the comparison
            tr = engine.train_batch(batch.clone(), loss_function=ppo_loss_fn())
        return {"inf": inf, "inf_dyn": inf_dyn, "tr": tr, "grads": engine_grads(engine), "a2a_bytes": counter.bytes,
                "dyn_costs": None if dyn_mbs is None else [_dedup_tokens(batch, b) for b in dyn_mbs.batches]}

    ulysses = {"ulysses_sequence_parallel_size": sp}
    out, stock_sp_runs = {"rank": rank}, {}
    for strategy in STRATEGIES:
        stock_sp = build_engine(ckpt, zorro=False, micro_batch_size=mbs, engine_overrides=ulysses,
                                attn_implementation=CPU_VARLEN_ATTN, strategy=strategy)
        runs = {"stock": run(build_engine(ckpt, zorro=False, micro_batch_size=mbs, strategy=strategy)),
                "stock_sp": run(stock_sp)}
        zorro = build_engine(ckpt, zorro=True, micro_batch_size=mbs, engine_overrides=ulysses, strategy=strategy)
        runs["zorro_sp"] = run(zorro)
        zmb = zorro.zorro_last_micro_batches
        # prefix trees under SP: an agentic batch per DP rank; engines with lr = 0 (the optimizer step leaves the
        # weights as loaded), so each compares on the checkpoint's weights whatever ran before
        frozen = dict(micro_batch_size=mbs, strategy=strategy, lr=0.0)
        tree = build_engine(ckpt, zorro=True, engine_overrides=ulysses, zorro_settings=PREFIX, **frozen)
        tree_td = _agentic_td(rank // sp, mbs, dp)
        tree_runs = {"stock": run(build_engine(ckpt, zorro=False, **frozen), tree_td, TREE_DYN_BUDGET),
                     "stock_sp": run(build_engine(ckpt, zorro=False, engine_overrides=ulysses,
                                                  attn_implementation=CPU_VARLEN_ATTN, **frozen), tree_td,
                                     TREE_DYN_BUDGET),
                     "zorro_sp": run(tree, tree_td, TREE_DYN_BUDGET)}
        tmb = tree.zorro_last_micro_batches
        runs["zorro_sp_prefix"] = run(tree)  # the prompt batch as a depth-one tree

        cfg = zorro.module.config
        res = {"rank": rank, "rows": int(mask.shape[0]), "response_lens": sorted(r.tolist()),
               "kv_heads": cfg.num_key_value_heads, "heads": cfg.num_attention_heads, "layers": cfg.num_hidden_layers,
               "head_dim": cfg.head_dim, "micro_batches": len(zmb), "split_groups": zmb.split_groups,
               "dedup_tokens": zmb.dedup_tokens, "ordinary_tokens": int((p + r).sum()),
               # tokens of each zorro micro-batch's packed row and of each stock micro-batch (rows in order, mbs each)
               "zorro_mb_tokens": [_dedup_tokens(td, b) for b in zmb.batches],
               "stock_mb_tokens": [int((p[i: i + mbs] + r[i: i + mbs]).sum()) for i in range(0, len(p), mbs)],
               "fallback": runs["zorro_sp"]["tr"]["metrics"]["zorro/fallback_batches"],
               "dyn_budget": DYN_BUDGET * sp, "zorro_dyn_mb_tokens": runs["zorro_sp"]["dyn_costs"],
               "a2a_bytes": {k: v["a2a_bytes"] for k, v in runs.items()}}
        for ref in ("stock_sp", "stock"):
            res[ref] = _compare(runs[ref], runs["zorro_sp"], td, mask)
        tmask = tree_td["response_mask"].bool()  # tool tokens (0 in it) are context: compared where trained
        res["tree"] = {ref: _compare(tree_runs[ref], tree_runs["zorro_sp"], tree_td, tmask)
                       for ref in ("stock_sp", "stock")}
        res["tree"]["depth_one_vs_stock_sp"] = _compare(runs["stock_sp"], runs["zorro_sp_prefix"], td, mask)
        res["tree"]["a2a_bytes"] = {k: v["a2a_bytes"] for k, v in tree_runs.items()}
        res["tree"]["plan_tokens"] = [_tree_tokens(tree_td, b) for b in tmb.batches]
        res["tree"]["stock_mb_tokens"] = [int(x) for x in _stock_mb_tokens(tree_td, mbs)]
        res["tree"]["ordinary_tokens"] = int(sum(res["tree"]["stock_mb_tokens"]))
        res["tree"]["fallback"] = tree_runs["zorro_sp"]["tr"]["metrics"]["zorro/fallback_batches"]
        res["tree"]["depth"] = tree_runs["zorro_sp"]["inf"]["metrics"]["zorro/tree_depth"][0]
        if world == sp:
            # the single-group run also checks the memory logits mode (with gradient checkpointing: the exchanges run
            # again in the recompute), verl's fused kernels (below) and the refusals
            mem = build_engine(ckpt, zorro=True, micro_batch_size=mbs, engine_overrides=ulysses, strategy=strategy,
                               zorro_settings={"logits_optimization": "memory"}, gradient_checkpointing=True)
            mem.logits_chunk_size = 4  # several chunks per rank's head rows
            runs["zorro_sp_memory"] = run(mem)
            res["stock_sp"]["memory"] = _compare(runs["stock_sp"], runs["zorro_sp_memory"], td, mask)
            if strategy == STRATEGIES[0]:  # what zorro refuses does not depend on the strategy
                res["refusals"] = _refusals(zorro, td, rank, mbs)
                res["hybrid"] = _hybrid_runs(ulysses, counter, sp, strategy)
            # one 24-token prompt, 4 short responses (T = 29): SP rank 0 holds prompt tokens only, so it runs the
            # head on no row at all (the common case at long context) and still takes part in every exchange
            long_td = make_engine_batch(batch_size=4, num_prompts=1, prompt_len=24, response_len=3, seed=5,
                                        micro_batch_size=4, global_batch_size=4)
            long_runs = [run(e, long_td) for e in (stock_sp, zorro)]
            res["stock_sp"]["head_rows_on_one_rank"] = _compare(*long_runs, long_td, long_td["response_mask"].bool())
            res["head_rows_per_rank"] = list(_shard_of(long_td, sp, rank).row_counts)
        # the stock SP engine against the stock engine without SP (the reference's own agreement)
        d = (response_values(runs["stock"]["inf"]["model_output"]["log_probs"], td)
             - response_values(runs["stock_sp"]["inf"]["model_output"]["log_probs"], td))
        res["stock_sp_vs_stock_log_probs_max_abs"] = d[mask].abs().max().item()
        out[strategy], stock_sp_runs[strategy] = res, runs["stock_sp"]
    for strategy in STRATEGIES if world == sp else ():
        # last: verl patches the model class's forward for fused kernels, for the whole process
        fused_td = td.clone()
        tu.assign_non_tensor(fused_td, use_fused_kernels=True)
        fused = build_engine(ckpt, zorro=True, micro_batch_size=mbs, model_overrides=FUSED_MODEL,
                             engine_overrides={**ulysses, "use_fused_kernels": True}, strategy=strategy)
        out[strategy]["stock_sp"]["fused"] = _compare(stock_sp_runs[strategy], run(fused, fused_td), td, mask)
    dist.barrier()
    dist.destroy_process_group()
    return out


def _compare(a: dict, b: dict, td, mask) -> dict:
    """Errors of run ``b`` against run ``a``: log-probs / entropy max abs, losses, grad norms, gradient rel."""
    from tests.support.verl_engines import response_values
    from zorro_verl.testing import grad_rel_error

    cmp = {}
    for key in ("log_probs", "entropy"):
        d = response_values(a["inf"]["model_output"][key], td) - response_values(b["inf"]["model_output"][key], td)
        cmp[f"{key}_max_abs"] = d[mask].abs().max().item()
    d = response_values(a["inf_dyn"]["model_output"]["log_probs"], td) - response_values(
        b["inf_dyn"]["model_output"]["log_probs"], td)
    cmp["log_probs_dynamic_bsz_max_abs"] = d[mask].abs().max().item()
    cmp["log_probs_max"] = response_values(a["inf"]["model_output"]["log_probs"], td)[mask].abs().max().item()
    cmp["loss"] = (sum(a["tr"]["loss"]), sum(b["tr"]["loss"]))
    # verl reports grad_norm on the first rank of each SP group only (is_mp_src_rank_with_outputs)
    norms = [x["tr"]["metrics"].get("grad_norm") for x in (a, b)]
    cmp["grad_norm"] = None if None in norms else [float(n) for n in norms]
    cmp["grad_rel"] = grad_rel_error(a["grads"], b["grads"])
    cmp["fallback"] = b["tr"]["metrics"].get("zorro/fallback_batches")
    return cmp


def _refusals(zorro, td, rank: int, mbs: int) -> dict:
    """What zorro refuses under SP: SP ranks holding different batches (raises on every rank of the group)."""
    from tests.support.verl_engines import make_engine_batch

    out = {}
    other = td if rank == 0 else make_engine_batch(batch_size=12, num_prompts=3, prompt_len=7, response_len=6,
                                                   seed=99, micro_batch_size=mbs)
    try:
        with zorro.eval_mode():
            zorro.infer_batch(other.clone(), loss_function=None)
        out["mismatch"] = "no error"
    except ValueError as e:
        out["mismatch"] = str(e)
    return out


#: zorro's prefix sharing as test_prefix_engine.py runs it.
PREFIX = {"sharing": "prefix", "min_shared_len": 4}


def _agentic_td(dp_rank: int, mbs: int, dp: int):
    """:func:`_agentic_rows` as a verl batch."""
    from tests.support.verl_engines import make_engine_batch

    return make_engine_batch(base=_agentic_rows(dp_rank), temperature=0.8, micro_batch_size=mbs,
                             global_batch_size=12 * dp)


def _agentic_rows(dp_rank: int) -> dict:
    """test_prefix_engine.py's agentic batch (a shared system prompt over 3 questions x 3 samples, one 3-turn
    multi-output trajectory with masked tool tokens; clusters interleaved), drawn per DP rank; padded layout."""
    from zorro_verl.testing import batch_from_rows, multi_turn_rows, shared_system_rows

    rows = shared_system_rows(3, 3, system_len=10, question_len=3, response_len=4, vocab_size=100, seed=7 + dp_rank)
    turns, masks = multi_turn_rows(3, first_prompt_len=5, turn_len=3, observation_len=2, vocab_size=100,
                                   seed=8 + dp_rank)
    order = [4, 9, 0, 11, 2, 7, 5, 1, 10, 3, 6, 8]
    rows, masks = rows + turns, [[1] * len(r) for _, r in rows] + masks
    return batch_from_rows([rows[i] for i in order], response_masks=[masks[i] for i in order],
                           include_training_fields=True, seed=9 + dp_rank)


def _hybrid_runs(ulysses: dict, counter, sp: int, strategy: str) -> dict:
    """Qwen3.5 and Qwen3-Next (gated delta-net layers) under SP through the zorro engine vs verl's stock engine
    without SP, run padded (``use_remove_padding=False``): verl's own SP path for these models needs
    flash-linear-attention's context-parallel kernels (Qwen3.5; Qwen3-Next has no SP path in verl 0.9.1), and its
    CPU remove-padding path leaks the recurrent state across packed rows (test_hybrid_engine.py). One 8-row,
    2-prompt batch, and for Qwen3.5 also the agentic batch with ``sharing=prefix``: inference and one training step;
    the all-to-all bytes of the training step."""
    import tempfile

    import torch

    from tests.support.verl_engines import build_engine, engine_grads, make_engine_batch, ppo_loss_fn, response_values
    from zorro_verl.testing import grad_rel_error, tiny_hybrid_model

    def prompt_batch(z):
        return make_engine_batch(batch_size=8, num_prompts=2, prompt_len=9, response_len=5, seed=5, shuffle=True,
                                 temperature=0.8, calculate_entropy=True, micro_batch_size=4, use_remove_padding=z)

    def tree_batch(z):
        return make_engine_batch(base=_agentic_rows(0), temperature=0.8, calculate_entropy=True, micro_batch_size=4,
                                 use_remove_padding=z)

    out = {}
    for name, kind, make, settings in (("qwen3_5", "qwen3_5", prompt_batch, None),
                                       ("qwen3_next", "qwen3_next", prompt_batch, None),
                                       ("qwen3_5_prefix", "qwen3_5", tree_batch, PREFIX)):
        with tempfile.TemporaryDirectory() as d:
            model = tiny_hybrid_model(kind, dtype=torch.float32, seed=0, exact=False)
            model.config.architectures = [type(model).__name__]
            model.save_pretrained(d)
            cfg = model.config
            batches = [make(z) for z in (False, True)]
            mask = batches[1]["response_mask"].bool()
            inf, tr, grads, sent = [], [], [], []
            for z, td in zip((False, True), batches):
                eng = build_engine(d, zorro=z, micro_batch_size=4, use_remove_padding=z, strategy=strategy,
                                   engine_overrides=ulysses if z else None, zorro_settings=settings if z else None)
                with eng.eval_mode():
                    inf.append(eng.infer_batch(td.clone(), loss_function=None))
                counter.bytes = 0
                with eng.train_mode(zero_grad_on_exit=False):
                    tr.append(eng.train_batch(td.clone(), loss_function=ppo_loss_fn()))
                sent.append(counter.bytes)
                grads.append(engine_grads(eng))
                if z:
                    zmb = eng.zorro_last_micro_batches
        res = {}
        for key in ("log_probs", "entropy"):
            a, b = (response_values(o["model_output"][key], t) for o, t in zip(inf, batches))
            res[f"{key}_max_abs"] = (a - b)[mask].abs().max().item()
            res[f"{key}_scale"] = a[mask].abs().max().item()
        res["loss"] = (sum(tr[0]["loss"]), sum(tr[1]["loss"]))
        norms = [x["metrics"].get("grad_norm") for x in tr]
        res["grad_norm"] = None if None in norms else [float(n) for n in norms]
        res["grad_rel"] = grad_rel_error(grads[0], grads[1])
        res["fallback"] = tr[1]["metrics"].get("zorro/fallback_batches")
        res["a2a_bytes"] = sent[1]
        res["mb_tokens"] = [(_tree_tokens if settings else _dedup_tokens)(batches[1], b) for b in zmb.batches]
        res["stock_mb_tokens"] = _stock_mb_tokens(batches[1], 4)  # stock's micro-batches (4 rows in order)
        res["shape"] = {"layer_types": list(cfg.layer_types), "heads": cfg.num_attention_heads,
                        "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
                        "k_heads": cfg.linear_num_key_heads, "v_heads": cfg.linear_num_value_heads,
                        "k_dim": cfg.linear_key_head_dim, "v_dim": cfg.linear_value_head_dim, "sp": sp}
        out[name] = res
    return out


def _tree_tokens(td, rows) -> int:
    """Tokens of the prefix-tree plan (:data:`PREFIX`) the zorro engine builds for ``rows`` of ``td``."""
    import torch

    from zorro_verl.integrations.verl.v09.batching import _to_verl_padded, row_lengths
    from zorro_verl.packing import build_plan

    p, r = row_lengths(td)
    ids, row, col = _to_verl_padded(td["input_ids"], p, r, int(p.max()), int(r.max()))
    am = ids.new_zeros(ids.shape)
    am[row, col] = 1
    idx = torch.tensor(rows)
    return build_plan(ids[idx], am[idx], int(r.max()), **PREFIX).T


def _stock_mb_tokens(td, mbs: int) -> list:
    """Tokens of each stock micro-batch (rows in order, ``mbs`` each)."""
    from zorro_verl.integrations.verl.v09.batching import row_lengths

    p, r = row_lengths(td)
    return [int((p[i: i + mbs] + r[i: i + mbs]).sum()) for i in range(0, len(p), mbs)]


def _shard_of(td, sp: int, rank: int):
    """The :class:`UlyssesShard` the zorro engine builds for ``td`` as one micro-batch."""
    from zorro_verl.integrations.verl.v09.batching import _to_verl_padded, row_lengths
    from zorro_verl.packing import build_plan
    from zorro_verl.packing.ulysses import ulysses_shard

    p, r = row_lengths(td)
    ids, row, col = _to_verl_padded(td["input_ids"], p, r, int(p.max()), int(r.max()))
    am = ids.new_zeros(ids.shape)
    am[row, col] = 1
    return ulysses_shard(build_plan(ids, am, int(r.max())), sp, rank)


def _dedup_tokens(td, rows) -> int:
    """Tokens of the packed row of ``rows``: each prompt once plus every response."""
    import torch

    from zorro_verl.integrations.verl.v09.batching import row_group_ids, row_lengths

    p, r = row_lengths(td)
    g = row_group_ids(td, p)
    idx = torch.tensor(rows)
    groups = torch.unique(g[idx])
    first = torch.stack([idx[g[idx] == k][0] for k in groups])
    return int(p[first].sum() + r[idx].sum())


if __name__ == "__main__":
    from tests.support.multi_rank import rank_main

    rank_main(run_rank, str, int)
