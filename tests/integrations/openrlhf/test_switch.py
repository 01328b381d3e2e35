"""The OpenRLHF switch, its options, the start-up argument check and the exact-size group micro-batches: the parts
that need no OpenRLHF (they run in the main suite too). The loader at interpreter start-up: test_loader_startup.py."""

import logging
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zorro_verl.integrations.openrlhf.actor import args_unsupported, check_args
from zorro_verl.integrations.openrlhf.batching import group_microbatches
from zorro_verl.integrations.openrlhf.layout import plan_from_openrlhf
from zorro_verl.integrations.openrlhf.settings import loader_options, settings_from_env, switch_on
from zorro_verl.integrations.verl.settings import ZorroSettings


def test_switch_values():
    assert switch_on({"ZORRO_OPENRLHF": "1"}) and switch_on({"ZORRO_OPENRLHF": " True "})
    assert not switch_on({}) and not switch_on({"ZORRO_OPENRLHF": "0"}) and not switch_on({"ZORRO_OPENRLHF": "off"})
    with pytest.raises(ValueError, match="ZORRO_OPENRLHF"):
        switch_on({"ZORRO_OPENRLHF": "maybe"})


def test_options_parse_and_validate():
    s = settings_from_env({"ZORRO_OPENRLHF": "1", "ZORRO_OPENRLHF_OPTIONS":
                           "attention_backend=sdpa, on_unsupported=warn,logits_optimization=compute,rollout_n=8,"
                           "group_balance=false"})
    assert s == ZorroSettings(enable=True, attention_backend="sdpa", on_unsupported="warn",
                              logits_optimization="compute", rollout_n=8, group_balance=False)
    assert settings_from_env({}) == ZorroSettings(enable=False)
    # the loader's own key: not one of verl's, parsed beside them
    env = {"ZORRO_OPENRLHF": "1", "ZORRO_OPENRLHF_OPTIONS": "version_check=warn,group_balance=false"}
    assert loader_options(env) == {"version_check": "warn"}
    assert settings_from_env(env) == ZorroSettings(enable=True, group_balance=False)
    assert loader_options({}) == {"version_check": "raise"}
    for bad, match in [("attention_backend=fast", "attention_backend"), ("colour=red", "unknown key"),
                       ("rollout_n=eight", "rollout_n"), ("enable=true", "set by ZORRO_OPENRLHF"),
                       ("sdpa", "key=value"), ("version_check=maybe", "version_check")]:
        with pytest.raises(ValueError, match=match):
            settings_from_env({"ZORRO_OPENRLHF": "1", "ZORRO_OPENRLHF_OPTIONS": bad})


def openrlhf_args(**over):
    args = SimpleNamespace(ds=SimpleNamespace(ring_attn_size=1, tensor_parallel_size=1, lora=SimpleNamespace(rank=0)),
                           actor=SimpleNamespace(aux_loss_coef=0.0))
    for key, value in over.items():
        group, name = key.split("__")
        setattr(getattr(args, group), name, value)
    return args


def test_start_up_argument_check(caplog):
    assert args_unsupported(openrlhf_args()) is None
    cases = {"ds__ring_attn_size": (2, "ring attention"), "ds__tensor_parallel_size": (2, "tensor parallelism"),
             "actor__aux_loss_coef": (0.01, "load-balancing")}
    for key, (value, match) in cases.items():
        assert match in args_unsupported(openrlhf_args(**{key: value}))
        with pytest.raises(ValueError, match=match):
            check_args(openrlhf_args(**{key: value}), ZorroSettings(enable=True))
    lora = openrlhf_args()
    lora.ds.lora.rank, lora.ds.lora.dropout = 8, 0.0
    assert args_unsupported(lora) is None  # LoRA runs deduplicated
    lora.ds.lora.dropout = 0.05  # ... except with dropout: one mask per sample in the ordinary forward
    assert "--ds.lora.dropout 0.05" in args_unsupported(lora)
    check_args(openrlhf_args(ds__ring_attn_size=2), ZorroSettings(enable=False))  # switch off: no check
    with caplog.at_level(logging.WARNING):
        check_args(openrlhf_args(ds__ring_attn_size=2), ZorroSettings(enable=True, on_unsupported="warn"))
    assert any("ring attention" in r.getMessage() for r in caplog.records)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=10), micro=st.integers(1, 8), seed=st.integers(0, 99))
def test_group_microbatches_exact_sizes(sizes, micro, seed):
    """Exactly ``B // micro`` micro-batches of exactly ``micro`` rows (the stock DataLoader's count and sizes with
    drop_last), no row twice, whole groups when every group fits the micro-batch size exactly in tiles."""
    g = [k for k, n in enumerate(sizes) for _ in range(n)]
    perm = torch.randperm(len(g), generator=torch.Generator().manual_seed(seed)).tolist()
    g = [g[i] for i in perm]  # siblings interleaved
    p = [3 + k for k in g]
    r = [1 + (i % 4) for i in range(len(g))]
    gb = group_microbatches(g, p, r, micro, generator=torch.Generator().manual_seed(seed))
    B = len(g)
    assert len(gb) == B // micro and all(len(mb) == micro for mb in gb.batches)
    rows = [b for mb in gb.batches for b in mb]
    assert len(set(rows)) == len(rows) == (B // micro) * micro
    owners = {}
    for k, mb in enumerate(gb.batches):
        for b in mb:
            owners.setdefault(g[b], set()).add(k)
    assert gb.split_groups == sum(1 for v in owners.values() if len(v) > 1)
    if all(n == micro for n in sizes):
        assert gb.split_groups == 0


def test_layout_refuses_malformed_rows():
    seq = torch.tensor([[5, 6, 7, 8, 0], [5, 6, 9, 0, 0]])
    am = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    act = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]])
    plan = plan_from_openrlhf(seq, am, act).plan
    assert (plan.G, plan.T, plan.N) == (1, 2 + 2 + 1, 3)  # one shared 2-token prompt
    with pytest.raises(ValueError, match="contiguous"):
        plan_from_openrlhf(seq, torch.tensor([[1, 0, 1, 1, 0], [1, 1, 1, 0, 0]]), act)
    with pytest.raises(ValueError, match="action_mask"):
        plan_from_openrlhf(seq, am, torch.tensor([[0, 1, 1, 1], [0, 1, 0, 0]]))  # an action on a pad
    with pytest.raises(ValueError, match="no valid token"):
        plan_from_openrlhf(seq, torch.tensor([[1, 1, 1, 1, 0], [0, 0, 0, 0, 0]]), act * torch.tensor([[1], [0]]))
