"""One rank of the GPU context-parallel check (tests/integrations/megatron/test_gpu_context_parallel.py): NCCL, one
GPU per rank, Transformer Engine's layer spec. Reference: an fp32 model at CP = 1 running megatron's ordinary
forward (right-padded rows, causal). Then the groups rebuilt with CP = 2 and two bf16 models: **stock CP** — verl's
THD path (``preprocess_thd_engine``: each row padded to ``2 cp``, zigzag chunks per rank; Transformer Engine's CP
attention, ``cp_comm_type`` p2p; ``postprocess_thd_engine`` gathering the logits back) — and **zorro CP** (each rank
its share of the packed row, keys / values all-gathered, :func:`zorro_gpt_step`). Returns the relative errors of
both against the reference (log-probs; every gradient summed over the CP group) for the relative rule.

Run as ``python -m tests.support.megatron_gpu_cp_ranks RANK WORLD INIT_FILE OUT_JSON``.
"""

from __future__ import annotations

import torch

from tests.support.multi_rank import rank_main

VOCAB = 512


def _model(dtype: torch.dtype, cp: int):
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=512, normalization="RMSNorm", gated_linear_unit=True,
                            activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                            params_dtype=dtype, bf16=dtype == torch.bfloat16, pipeline_dtype=dtype,
                            apply_rope_fusion=False, use_cpu_initialization=True, context_parallel_size=cp)
    torch.manual_seed(0)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
                    vocab_size=VOCAB, max_sequence_length=512, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False).cuda()


def _rows(ids, am, R):
    Pw = ids.shape[1] - R
    out = []
    for b in range(ids.shape[0]):
        p, r = int(am[b, :Pw].sum()), int(am[b, Pw:].sum())
        out.append((torch.cat([ids[b, Pw - p:Pw], ids[b, Pw:Pw + r]]), p, r))
    return out


def _logprobs(per_row_logits, rows):
    out = []
    for logits, (t, p, r) in zip(per_row_logits, rows):
        if r:
            lp = torch.log_softmax(logits[p - 1:p + r - 1].float(), -1)
            out.append(lp.gather(-1, t[p:p + r, None])[:, 0])
    return torch.cat(out)


def _grads(model, group=None):
    import torch.distributed as dist

    g = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    if group is not None:
        for t in g.values():
            dist.all_reduce(t, group=group)
    return g


def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def run_rank(rank: int, world: int, init_file: str) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from zorro_verl.integrations.megatron import install_zorro_megatron, zorro_gpt_step
    from zorro_verl.packing import build_plan
    from zorro_verl.testing import create_dummy_batch

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    b = create_dummy_batch(8, 2, 96, 32, device="cuda", add_padding=True, shuffle=True, seed=2, vocab_size=VOCAB)
    ids, am, R = b["input_ids"], b["attention_mask"], b["responses"].shape[1]
    rows = _rows(ids, am, R)
    # reference: fp32, CP = 1, the ordinary forward on right-padded rows (the same on every rank)
    ref = _model(torch.float32, cp=1)
    L = max(len(t) for t, _, _ in rows)
    batch = torch.zeros(len(rows), L, dtype=torch.long, device="cuda")
    for i, (t, _, _) in enumerate(rows):
        batch[i, :len(t)] = t
    logits = ref(input_ids=batch, position_ids=torch.arange(L, device="cuda")[None].expand(len(rows), L),
                 attention_mask=None)
    lp_ref = _logprobs(list(logits), rows)
    lp_ref.sum().backward()
    g_ref = _grads(ref)
    state = {k: v for k, v in ref.state_dict().items()}

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    cp_group = parallel_state.get_context_parallel_group()
    from verl.models.mcore.util import postprocess_thd_engine, preprocess_thd_engine

    stock = _model(torch.bfloat16, cp=world)
    stock.load_state_dict(state)
    nested = torch.nested.as_nested_tensor([t for t, _, _ in rows], layout=torch.jagged)
    ids_rmpad, psp, _ = preprocess_thd_engine(nested, pre_process=True)
    out = stock(input_ids=ids_rmpad, position_ids=None, attention_mask=None, packed_seq_params=psp)
    per_row = postprocess_thd_engine(out, psp, nested, len(rows), post_process=True)
    lp_stock = _logprobs(per_row.unbind(), rows)
    lp_stock.sum().backward()
    g_stock = _grads(stock, cp_group)

    zorro = _model(torch.bfloat16, cp=world)
    zorro.load_state_dict(state)
    install_zorro_megatron(zorro)
    plan = build_plan(ids, am, R)
    lp, _ = zorro_gpt_step(zorro, plan, backend="sdpa")
    lp.float().sum().backward()
    g = _grads(zorro, cp_group)
    zorro.zero_grad(set_to_none=True)
    lp_f, _ = zorro_gpt_step(zorro, plan, backend="flash_copyfree")  # the varlen CP attention on the flash kernels
    lp_f.float().sum().backward()
    g_f = _grads(zorro, cp_group)
    res = {"lp": _rel(lp, lp_ref), "lp_stock": _rel(lp_stock, lp_ref),
           "grad": max(_rel(g[n], g_ref[n]) for n in g_ref),
           "grad_stock": max(_rel(g_stock[n], g_ref[n]) for n in g_ref),
           "lp_flash": _rel(lp_f, lp_ref), "grad_flash": max(_rel(g_f[n], g_ref[n]) for n in g_ref)}
    dist.barrier()
    return res


if __name__ == "__main__":
    rank_main(run_rank)
