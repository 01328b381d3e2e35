"""packed_routes: the packed row's MoE routes for router replay, and the check that every copy of a deduplicated
prompt token carries the same routes (vs a per-token loop over the batch)."""

import pytest
import torch

from tests.support import megatron_cpu as M
from zorro_verl.packing import build_plan
from zorro_verl.packing.routes import packed_routes

L, K = 3, 2


def _consistent_routes(ids, am, plan, seed=0):
    """Routes a token-wise router would record: a function of the token's packed position (so every copy of a
    prompt token agrees), random elsewhere (pads)."""
    g = torch.Generator().manual_seed(seed)
    per_packed = torch.randint(0, 8, (plan.T, L, K), generator=g)
    fi = plan.full_index()
    routes = torch.randint(0, 8, (*ids.shape, L, K), generator=g)
    routes[fi >= 0] = per_packed[fi[fi >= 0]]
    return routes, per_packed


@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
def test_agreeing_routes_are_packed(sharing):
    ids, am, R = M.make_batch(shared_prefix=sharing == "prefix")
    plan = build_plan(ids, am, R, sharing=sharing, **({"min_shared_len": 1} if sharing == "prefix" else {}))
    routes, per_packed = _consistent_routes(ids, am, plan)
    got, mask = packed_routes(plan, routes)
    assert mask is None and torch.equal(got, per_packed)
    # a loop over every valid token: its routes are those of the packed token it is a copy of
    fi = plan.full_index()
    for b in range(plan.B):
        for s in range(plan.S):
            if am[b, s]:
                assert torch.equal(routes[b, s], got[fi[b, s]])


@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
def test_disagreeing_prompt_routes_are_refused(sharing):
    ids, am, R = M.make_batch(shared_prefix=sharing == "prefix")
    plan = build_plan(ids, am, R, sharing=sharing, **({"min_shared_len": 1} if sharing == "prefix" else {}))
    routes, _ = _consistent_routes(ids, am, plan)
    Pw = ids.shape[1] - R
    src = int(plan.source_index[plan.full_index()[0, Pw - 1]]) // plan.S  # the row group 0's prompt is read from
    b = next(r for r in (0, 2, 4) if r != src)  # another row of group 0
    routes[b, Pw - 1, 1, 0] += 1  # its last prompt token, layer 1
    with pytest.raises(ValueError, match=rf"router replay.*group\(s\) \[0\].*row {b}, column {Pw - 1}, expected the "
                                         rf"routes of row {src}"):
        packed_routes(plan, routes)
    # the same change on a response token (computed once per row anyway) or a pad is no disagreement
    routes, _ = _consistent_routes(ids, am, plan)
    routes[0, Pw, 0, 0] += 1
    routes[1, Pw + 1, 0, 0] += 1  # row 1's response is empty: a pad
    packed_routes(plan, routes)


def test_replay_mask():
    ids, am, R = M.make_batch()
    plan = build_plan(ids, am, R)
    routes, per_packed = _consistent_routes(ids, am, plan)
    mask = am.bool().clone()
    Pw = ids.shape[1] - R
    mask[0, Pw + 3] = False  # row 0's last token keeps its native route (R3): no disagreement possible there
    got, m = packed_routes(plan, routes, mask)
    assert torch.equal(got, per_packed) and m.sum() == plan.T - 1
    mask[2, Pw - 1] = False  # a prompt token replayed in row 0 but not in row 2 (same group): refused
    with pytest.raises(ValueError, match="router replay"):
        packed_routes(plan, routes, mask)
    with pytest.raises(ValueError, match="routes: expected"):
        packed_routes(plan, routes[:, :-1])
