"""MoE router statistics for the Megatron tests (never shipped; tests/integrations/megatron/test_moe.py): a tiny fp64
MoE ``GPTModel`` with megatron's load-balancing losses, z-loss and expert bias on, a batch whose ordinary rows need no
padding, and one run of megatron's ordinary forward (the reference, no project code) or of the zorro step that
collects everything the statistics touch: log-probs / entropy, every gradient, the logged MoE metrics, the routers'
expert-bias token counts and the bias after megatron's own update.

The reference is :func:`tests.support.megatron_cpu.stock_outputs` (the rows as one ``[B, L]`` batch). Megatron counts
every token of that batch in its statistics unless a ``padding_mask`` is passed (whose expert-bias path does not
broadcast in megatron-core 0.19.2), so the batch's rows all have the same length ``L``: the reference's statistics are
then over exactly the ordinary tokens.
"""

from __future__ import annotations

import torch

from tests.support import megatron_cpu as M

__all__ = ["STATS", "expert_bias_on", "make_uniform_batch", "run_moe", "compare_moe", "alltoall_cpu_shims",
           "METRICS", "reset_statistics", "reported_metrics", "collect"]

#: every statistic zorro weights, on at once: the load-balancing loss per micro-batch and over the global batch,
#: the z-loss (coefficients large enough that a prompt token counted once instead of n times shows in every gradient)
STATS = {"moe_router_load_balancing_type": ["aux_loss", "global_aux_loss"], "moe_aux_loss_coeff": [0.5, 0.4],
         "moe_z_loss_coeff": 0.2}
#: the metrics megatron's routers log for them
METRICS = ("load_balancing_loss", "global_load_balancing_loss", "z_loss")


def expert_bias_on(cfg) -> None:
    """The expert bias (aux-loss-free balancing) on a softmax router. megatron's config validation allows it with
    sigmoid / sqrtsoftplus scores only, whose ``logits.float()`` rounds an fp64 model's router to fp32 (the fp64
    comparison would then see fp32 rounding); the counting (``_apply_expert_bias``) and the update
    (``finalize_model_grads``) are the same code for every score function, and softmax routing ignores the bias in
    its choice."""
    cfg.moe_router_enable_expert_bias = True


def make_uniform_batch(seed: int = 3, L: int = 10, shared_prefix: bool = False):
    """A verl-style padded batch ``(input_ids [B, S], attention_mask [B, S], R)`` whose rows all hold ``L`` valid
    tokens (prompt + response): four prompts of 6, 4, 5 and ``L`` tokens, rows interleaved (groups
    ``0 1 0 2 1 0 3 2``), responses ``L - P`` long (group 3's is empty); the prompt plan's packed row then has
    ``8 L - 21`` tokens, odd: under sequence parallelism zorro's row gets a pad token. ``shared_prefix``: prompts 1
    and 2 start with prompt 0's first 3 / 4 tokens (a prefix tree)."""
    g = torch.Generator().manual_seed(seed)
    plens = [6, 4, 5, L]
    prompts = [torch.randint(1, M.VOCAB, (p,), generator=g) for p in plens]
    if shared_prefix:
        prompts[1] = torch.cat([prompts[0][:3], prompts[1][3:]])
        prompts[2] = torch.cat([prompts[0][:4], prompts[2][4:]])
    groups = [0, 1, 0, 2, 1, 0, 3, 2]
    R = L - min(plens)
    ids = torch.zeros(len(groups), L + R, dtype=torch.long)
    am = torch.zeros_like(ids)
    for b, grp in enumerate(groups):
        p = prompts[grp]
        r = L - len(p)
        ids[b, L - len(p):L] = p
        ids[b, L:L + r] = torch.randint(1, M.VOCAB, (r,), generator=g)
        am[b, L - len(p):L + r] = 1
    return ids, am, R


def reset_statistics(model, keep_bias: bool = False) -> None:
    """Fresh statistics for one run: the metrics tracker (its per-layer entries created in fp64: megatron's are
    fp32, which would round the logged fp64 losses), the routers' token counts and global-batch accumulators, and
    (unless ``keep_bias``: a next training step) the expert bias."""
    from megatron.core.transformer.moe.moe_logging import MetricEntry, get_moe_metrics_tracker

    from zorro_verl.integrations.megatron.moe import moe_routers

    tracker = get_moe_metrics_tracker()
    tracker.clear()
    n = model.config.num_layers
    for name in METRICS:
        tracker.metrics[name] = MetricEntry(values=torch.zeros(n, dtype=torch.float64))
    for r in moe_routers(model):
        for buf in ("local_tokens_per_expert", "global_tokens_per_expert", "ga_steps"):
            if getattr(r, buf, None) is not None:
                getattr(r, buf).zero_()
        if r.expert_bias is not None and not keep_bias:
            r.expert_bias.zero_()
    model.zero_grad(set_to_none=True)


def reported_metrics(entries: dict) -> dict:
    """The logged metrics as megatron reports them (``MoEMetricsTracker._sync_metrics``: summed over the entry's
    ``reduce_group``, averaged over its ``avg_group``, then over the data-parallel ranks), on copies; an average as
    a sum over the group's size (gloo has no ``ReduceOp.AVG``)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    def avg(v, group):
        dist.all_reduce(v, group=group)
        v /= dist.get_world_size(group)

    out = {}
    for name, e in entries.items():
        v = e.values.clone()
        dist.all_reduce(v, group=parallel_state.get_pipeline_model_parallel_group())
        if e.reduce_group is not None:
            dist.all_reduce(v, group=e.reduce_group)
        if e.avg_group is not None:
            avg(v, e.avg_group)
        if e.needs_dp_avg:
            avg(v, parallel_state.get_data_parallel_group(with_context_parallel=False, partial_data_parallel=False))
        out[name] = v
    return out


def run_moe(model, batch, *, zorro: bool, sharing: str = "prompt", tp_multiple: int = 1,
            keep_bias: bool = False) -> dict:
    """One forward + backward of the test loss (:func:`~tests.support.megatron_cpu.stock_outputs` for the
    reference, :func:`~tests.support.megatron_cpu.zorro_outputs` for zorro) from fresh statistics, then megatron's
    expert-bias update (``finalize_model_grads``' ``_update_router_expert_bias``, all-reduced over TP x DP);
    ``keep_bias``: from the bias the model has (a next step) instead of zero.
    Returns ``lp [N]``, ``ent [N]``, ``grads`` (name -> tensor), ``metrics`` (name -> ``[layers]`` fp64 as megatron
    reports them), ``counts`` (each router's ``local_tokens_per_expert`` ``[E]`` summed over TP x DP, as the update
    sums them) and ``bias`` (each router's updated ``expert_bias`` ``[E]``)."""
    reset_statistics(model, keep_bias)
    ids, am, R = batch
    if zorro:
        lp, ent, plan = M.zorro_outputs(model, ids, am, R, sharing=sharing)
    else:
        (lp, ent), plan = M.stock_outputs(model, ids, am, R, tp_multiple=tp_multiple), None
    return {"lp": lp, "ent": ent, "plan": plan, **collect(model)}


def collect(model) -> dict:
    """After a training forward + backward from :func:`reset_statistics`: ``grads``, ``metrics`` (as reported),
    ``counts`` (summed over TP x DP) and ``bias`` (after megatron's update) of :func:`run_moe`."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from zorro_verl.integrations.megatron.moe import moe_routers

    metrics = reported_metrics(get_moe_metrics_tracker().metrics)
    routers = moe_routers(model)
    counts = [r.local_tokens_per_expert.clone() for r in routers]
    for c in counts:  # what the update sums: each sequence-parallel rank counts its shard, each DP rank its batch
        dist.all_reduce(c, group=parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True))
    _update_router_expert_bias([model], model.config)
    return {"grads": M.grads(model), "metrics": metrics, "counts": counts,
            "bias": [r.expert_bias.clone() for r in routers]}


def compare_moe(stock: dict, zorro: dict) -> dict:
    """Zorro vs the reference: :func:`~tests.support.megatron_cpu.compare`'s log-prob / entropy / gradient
    differences, the logged metrics' largest relative difference (``metric_rel``; ``metrics_on``: every metric of
    :data:`METRICS` logged nonzero on both sides), the token counts' largest difference (``count``, exact integers;
    ``tokens``: their total) and the updated bias' (``bias``; ``bias_moved``: the update changed it)."""
    res = M.compare((stock["lp"], stock["ent"]), (zorro["lp"], zorro["ent"]), stock["grads"], zorro["grads"])
    assert stock["metrics"].keys() == zorro["metrics"].keys()
    res["metric_rel"] = max(((zorro["metrics"][k] - v).abs().max() / v.abs().max().clamp_min(1e-300)).item()
                            for k, v in stock["metrics"].items())
    res["metrics_on"] = all(bool((side["metrics"][k] != 0).all()) for k in METRICS for side in (stock, zorro))
    res["count"] = max((z - s).abs().max().item() for s, z in zip(stock["counts"], zorro["counts"]))
    res["tokens"] = float(sum(s.sum().item() for s in stock["counts"]))
    res["bias"] = max((z - s).abs().max().item() for s, z in zip(stock["bias"], zorro["bias"]))
    res["bias_moved"] = all(bool((s != 0).any()) for s in stock["bias"])
    res["routers"] = len(stock["counts"])
    return res


class _CpuStream:
    """The alltoall dispatcher's device-to-host stream on the CPU: everything runs in order, so waiting, recording and
    synchronising do nothing (``record_event`` returns another such object, whose ``synchronize`` is a no-op)."""

    def __getattr__(self, name):
        return (lambda *a, **k: _CpuStream()) if name == "record_event" else (lambda *a, **k: None)


def alltoall_cpu_shims() -> None:
    """M1, for megatron's ``MoEAlltoAllTokenDispatcher`` on the CPU (idempotent; test processes only): it turns its
    all-to-all split sizes into numpy through ``maybe_move_tensor_to_cpu(as_numpy=True)``, which converts only CUDA
    tensors; a CPU tensor then reaches ``all_to_all_single``, whose binding refuses it as split sizes. Here
    ``as_numpy`` converts CPU tensors too. Its device-to-host stream (a class attribute made at the first
    dispatcher's construction) is a :class:`_CpuStream`; under TP > 1 also M2 (:func:`_uneven_sequence_collectives`).
    The forward and backward also need
    :func:`tests.support.megatron_cpu.cuda_as_cpu` (``torch.cuda.current_stream`` / ``stream``)."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor):
            tensor = tensor.cpu()
            if as_numpy:
                tensor = tensor.numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _CpuStream()
    _uneven_sequence_collectives()


def _uneven_sequence_collectives() -> None:
    """M2 (the all-to-all dispatcher under TP > 1): it gathers / reduce-scatters the tokens over the TP group in
    unequal parts (``output_split_sizes`` / ``input_split_sizes``), through ``all_gather`` / ``reduce_scatter`` with
    tensor lists of different sizes, which gloo refuses (equal sizes only) or lacks. Here the unequal cases are
    computed by collectives gloo has: every part padded to the largest, gathered, and cut; the whole tensor
    all-reduced (a sum over the group) and this rank's part kept."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    if getattr(mappings, "_zorro_test_uneven", False):
        return
    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        m = max(output_split_sizes)
        padded = torch.cat([input_, input_.new_zeros(m - input_.shape[0], *input_.shape[1:])])
        parts = [torch.empty_like(padded) for _ in output_split_sizes]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p[:n] for p, n in zip(parts, output_split_sizes)])

    def scatter_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        return torch.split(total, input_split_sizes, dim=0)[group.rank()].contiguous()

    mappings._gather_along_first_dim = gather_uneven
    mappings._reduce_scatter_along_first_dim = scatter_uneven
    mappings._zorro_test_uneven = True
