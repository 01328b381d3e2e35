"""One rank of the vision-language Ulysses engine check (tests/integrations/verl/v09/test_vlm_ulysses.py): gloo with
a ``file://`` rendezvous, the CPU platform, fp32 FSDP2 over 2 ranks that form one SP group (both hold the same batch).

Run as ``python -m tests.support.verl_vlm_ulysses RANK WORLD INIT_FILE SPEC_JSON OUT_JSON``; ``SPEC_JSON`` holds
``{"ckpts": {family: path}}``. Per family, two optimizer steps (inference pass, then a training step, plain SGD:
:func:`tests.support.verl_engines.run_steps`) on the VLM batches of the pairwise matrix
(:func:`tests.support.verl_matrix.global_rows`: 4 prompts x 4 rollouts, one and two images, two prompts with
identical tokens and other pixels, a text-only prompt, shuffled; fixed micro-batches of 4 rows) by:

* ``stock``: verl's stock engine without SP (the 2 ranks are DP ranks holding the same batch: the same global step);
* ``stock_sp``: verl's stock engine with ``ulysses_sequence_parallel_size = 2`` (Qwen2.5-VL only): every rank
  encodes the micro-batch's images and merges them into the whole packed row, then verl's slicing patch of the
  language model hands each rank its slice of the embeddings and of the 4-row positions; verl's Qwen2-VL attention
  exchanges the shards. On CPU its flash-attn calls run the test-only stand-ins of
  :func:`tests.support.verl_vlm.cpu_stock_vlm_kernels` (as the stock VLM engine tests);
* ``zorro_sp``: the zorro engine with SP = 2.

Results (:func:`tests.support.verl_engines.step_errors` of zorro against each stock engine, the images each engine's
vision tower encoded, the all-to-all bytes) go to ``OUT_JSON``.
"""

from __future__ import annotations

import os
import time

__all__ = ["run_rank", "FAMILIES"]

#: Families and whether verl's stock SP path runs for them on CPU (Qwen2.5-VL: its own attention forward, whose
#: flash-attn calls have CPU stand-ins; Qwen3-VL's stock SP attention is transformers' flash-attention integration).
FAMILIES = {"qwen2_5_vl": True, "qwen3_vl": False}


class _Counts:
    """Counts the bytes this rank hands ``torch.distributed.all_to_all`` and the images the vision towers encode."""

    def __init__(self):
        import torch.distributed as dist

        self.bytes = 0
        self.images = 0
        orig = dist.all_to_all

        def counted(output_list, input_list, *args, **kwargs):
            self.bytes += sum(t.numel() * t.element_size() for t in input_list)
            return orig(output_list, input_list, *args, **kwargs)

        dist.all_to_all = counted

    def watch(self, engine):
        owner = next(m for m in engine.module.modules() if hasattr(m, "visual"))

        def hook(mod, args, kwargs, out):
            self.images += int(kwargs.get("grid_thw", args[-1] if args else None).shape[0])

        return owner.visual.register_forward_hook(hook, with_kwargs=True)


def run_rank(rank: int, world: int, init_file: str, spec_path: str) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      VERL_ENGINE_DEVICE="cpu", OMP_NUM_THREADS="1")
    import gc
    import json

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from tests.support.verl_cpu_platform import use_cpu_platform
    from tests.support.verl_vlm import reset_verl_patches, tiny_vlm_config  # before any engine: captures forwards

    use_cpu_platform()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import verl.workers.engine  # noqa: F401  (registers the zorro engine)

    from tests.support.verl_engines import STEPS_OPTIM, build_engine, run_steps, step_errors
    from tests.support.verl_matrix import MICRO_BATCH, TOKEN_BUDGET, _engine_batch, global_rows
    from tests.support.verl_vlm import cpu_stock_vlm_kernels

    with open(spec_path) as f:
        spec = json.load(f)
    counts = _Counts()
    out = {"rank": rank, "families": {}}
    for family, stock_sp in FAMILIES.items():
        t0 = time.perf_counter()
        cfg = tiny_vlm_config(family)
        batches = []
        for step in range(2):
            base = global_rows("vlm", step, 1, cfg)
            B = len(base["uid"])
            batches.append(_engine_batch(base, "vlm", {"dynamic_bsz": False}, True, False, B, None))

        def run(zorro: bool, sp: int, ckpt=spec["ckpts"][family], batches=batches):
            reset_verl_patches()  # each engine gets exactly its own config's class patches
            eng = build_engine(ckpt, zorro=zorro, strategy="fsdp2", micro_batch_size=MICRO_BATCH,
                               max_token_len=TOKEN_BUDGET["vlm"], optim_overrides=STEPS_OPTIM,
                               engine_overrides={"ulysses_sequence_parallel_size": sp} if sp > 1 else None)
            handle = counts.watch(eng)
            counts.bytes = counts.images = 0
            steps = run_steps(eng, batches)
            handle.remove()
            res = {"steps": steps, "bytes": counts.bytes, "images": counts.images}
            del eng
            gc.collect()
            return res

        with cpu_stock_vlm_kernels():  # test-only CPU stand-ins for the stock path's flash-attn calls
            runs = {"stock": run(False, 1)}
            if stock_sp:
                runs["stock_sp"] = run(False, 2)
        runs["zorro_sp"] = run(True, 2)
        reset_verl_patches()
        fam = {"seconds": 0.0}
        for ref in ("stock", "stock_sp"):
            if ref in runs:
                fam[ref] = step_errors(runs[ref]["steps"], runs["zorro_sp"]["steps"], batches)
        m = runs["zorro_sp"]["steps"][0]["inf"]["metrics"]
        fam["dedup_ratio"] = m["zorro/dedup_ratio"][0]
        fam["images"] = {k: v["images"] for k, v in runs.items()}
        fam["a2a_bytes"] = {k: v["bytes"] for k, v in runs.items()}
        fam["seconds"] = time.perf_counter() - t0
        out["families"][family] = fam
        dist.barrier()
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    from tests.support.multi_rank import rank_main

    rank_main(run_rank, str)
