"""One real local Ray cluster: verl's RayWorkerGroup of 2 CPU workers, FSDP2 over gloo, zorro vs stock engine.

Each rank gets different groups (rank 0: four 2-row groups, rank 1: groups of 3, 3, 2) so the group-aware
micro-batching needs 2 vs 3 micro-batches locally; the engine must run 3 on both ranks (all-reduce MAX).
"""

import os

import pytest

pytestmark = pytest.mark.usefixtures("verl_cpu")


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    from tests.support.verl_cpu_platform import worker_env

    # the CPU platform reaches the workers through VERL_USE_EXTERNAL_MODULES (imported first at `import verl`)
    env = {**worker_env(), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "0"}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": env, "working_dir": None},
             _system_config={"metrics_report_interval_ms": 100000})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def worker_group(ray_cluster):
    from verl.single_controller.ray.base import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    from tests.support.verl_engines import ray_engine_worker_class

    cls = RayClassWithInitArgs(cls=ray_cluster.remote(ray_engine_worker_class()))
    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1)
    return RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls)


@pytest.mark.parametrize("dynamic", [False, True])
def test_ray_worker_group_zorro_equals_stock(worker_group, tiny_ckpt, dynamic):
    results = sorted(worker_group.compare(tiny_ckpt, dynamic), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1]
    if not dynamic:
        assert [r["local_fixed_count"] for r in results] == [2, 3]  # the ranks disagree locally ...
        assert [r["zorro_count"] for r in results] == [3, 3]  # ... and the engine syncs them
    else:
        assert results[0]["zorro_count"] == results[1]["zorro_count"]
    for r in results:
        if r["has_entry_point"]:
            assert r["registered_by_plugin"], "the verl.plugins entry point did not register the engine in a worker"
        assert r["logp_max_abs"] <= 1e-5 and r["entropy_max_abs"] <= 1e-5
        (la, lb), (ga, gb) = r["loss"], r["grad_norm"]
        assert abs(la) > 1e-4 and abs(la - lb) <= 1e-5 * abs(la)
        assert ga > 1e-4 and abs(ga - gb) <= 1e-5 * ga
        assert r["grad_rel"] <= 1e-5  # every parameter's gradient, relative to the largest gradient entry
        assert r["zorro_metrics"]["zorro/fallback_batches"] == [0.0]
    # the DP loss is the sum over ranks (verl normalises globally): compare it across engines
    total_a, total_b = sum(r["loss"][0] for r in results), sum(r["loss"][1] for r in results)
    assert abs(total_a - total_b) <= 1e-5 * abs(total_a)
    print({r["rank"]: {k: r[k] for k in ("logp_max_abs", "entropy_max_abs", "loss", "grad_norm", "grad_rel")}
           for r in results}, os.getpid())
