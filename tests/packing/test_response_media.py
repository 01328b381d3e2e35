"""Images inside responses (a multi-turn agent whose tool returns an image): ``batch_media``, ``build_media_plan`` and
``pack_media`` on rows whose media lie in the prompt only, in the response only, or in both; two rows of a group
with different response images; identical response images (equal pixels in separate tensors) in several rows;
``sharing="prompt"`` and ``"prefix"``.

No model: what the model would do with the packed row is checked directly. It scatters the packed items' features
over the packed row's placeholders of their kind in order, so for every row and each of its items, the packed
placeholders its tokens map to (``plan.full_index``) must be exactly the placeholders of one packed item with the
row's pixels and grid; the packed 3-D positions must be every row's own at every token (prompt and response).
"""

import pytest
import torch

from zorro_verl.packing.multimodal import (
    MediaTokens,
    batch_media,
    build_media_plan,
    check_shared_positions,
    keyed_id,
)
from zorro_verl.testing.vlm import IMAGE, MERGE, VIDEO, agent_row, image, vlm_batch

TOKENS = MediaTokens(IMAGE, VIDEO, MERGE)


def _rows() -> list:
    """Siblings interleaved. Prompts: A (image a), B (same tokens as A, another image of the same size), T (text).
    Tool images x, y (another size), x2 (x's pixels in another tensor)."""
    a, b = image(1), image(2)
    x, y = image(21), image(22, 2, 3)
    x2 = (x[0].clone(), x[1].clone())
    A, B, T = [[1, 2], a, [3, 4]], [[1, 2], b, [3, 4]], [[5, 6, 7]]
    return [
        agent_row(A, [[30, 31]]),  # 0: prompt image only
        agent_row(T, [[40], x, [41]]),  # 1: response image only
        agent_row(A, [[32], x, [33, 34]]),  # 2: both
        agent_row(B, [[32], x2, [33, 35]]),  # 3: both; B's prompt, x's pixels in another tensor
        agent_row(T, [[40], x2, [42], y, [43]]),  # 4: two response images, its prefix [40, x] equal to row 1's
        agent_row(A, [[32], y, [36]]),  # 5: A's group, another response image than row 2's
        agent_row(A, [[32], x2, [33, 37]]),  # 6: A's group, row 2's response start with x's pixels
        agent_row(T, [[44, 45]]),  # 7: text only
    ]


def _positions(keyed: torch.Tensor, am: torch.Tensor) -> torch.Tensor:
    """``[3, B, S]`` positions that are a function of each token's prefix (tokens and media, via the keyed ids), as
    3-D rotary positions are, and that differ between rows whose prefixes differ: axis 0 counts valid tokens, axes 1
    and 2 add running sums of the keyed ids modulo two primes."""
    valid = am.bool()
    count = valid.long().cumsum(1) - 1
    ids = torch.where(valid, keyed, 0)
    h1 = torch.remainder(ids, 97).cumsum(1)
    h2 = torch.remainder(ids, 89).cumsum(1)
    return torch.stack([count, count + h1, count + h2]) * valid


def _setup(sharing: str):
    rows = _rows()
    batch = vlm_batch(rows)
    ids, am, R = batch["input_ids"], batch["attention_mask"], batch["responses"].shape[1]
    bm = batch_media(ids, am, R, batch["media"], TOKENS)
    pos = _positions(bm.keyed_ids, am)
    kw = {"min_shared_len": 1} if sharing == "prefix" else {}
    plan, packed = build_media_plan(ids, am, R, batch["media"], TOKENS, pos, sharing=sharing, **kw)
    return rows, batch, bm, pos, plan, packed


def _row_items(row) -> list:
    """``(pixels, grid)`` of a row's images, in placeholder order."""
    if row.media is None:
        return []
    out, p0 = [], 0
    for g in row.media["image_grid_thw"]:
        n = int(g.prod())
        out.append((row.media["pixel_values"][p0:p0 + n], g))
        p0 += n
    return out


def _scattered(plan, packed, batch, rows) -> dict:
    """The model's scatter, checked per row item: ``{(b, j): packed item index}``."""
    ids = plan.input_ids
    pix, grid = packed.inputs["pixel_values"], packed.inputs["image_grid_thw"]
    n_tok = (grid.prod(-1) // MERGE ** 2).tolist()
    starts = [0] + grid.prod(-1).cumsum(0).tolist()
    slot = {}  # packed placeholder -> (packed item, offset): the model's scatter order
    k = o = 0
    for t in torch.nonzero(ids == IMAGE)[:, 0].tolist():
        slot[t] = (k, o)
        o += 1
        if o == n_tok[k]:
            k, o = k + 1, 0
    assert (k, o) == (len(n_tok), 0), "every packed placeholder is covered by the packed items, in full"
    full = plan.full_index()
    out = {}
    for b, row in enumerate(rows):
        cols = torch.nonzero((batch["input_ids"][b] == IMAGE) & batch["attention_mask"][b].bool())[:, 0]
        c0 = 0
        for j, (px, g) in enumerate(_row_items(row)):
            n = int(g.prod()) // MERGE ** 2
            got = [slot[int(t)] for t in full[b, cols[c0:c0 + n]]]
            k = got[0][0]
            assert got == [(k, i) for i in range(n)], (b, j, got)
            assert torch.equal(grid[k], g) and torch.equal(pix[starts[k]:starts[k + 1]], px), (b, j)
            out[(b, j)] = k
            c0 += n
    return out


def test_response_images_are_keyed_and_marked():
    rows, batch, bm, *_ = _setup("prompt")
    Pw = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    flags = [[it.in_response for it in r] for r in bm.items]
    assert flags == [[False], [True], [False, True], [False, True], [True, True], [False, True], [False, True], []]
    for b, r in enumerate(bm.items):
        for it in r:
            assert all((c >= Pw) == it.in_response for c in it.cols)
            assert bm.keyed_ids[b, it.cols].eq(keyed_id(it.key)).all()
    # equal pixels share a key wherever they lie: x in rows 1, 2 (tensor x), 3, 4, 6 (tensor x2)
    xs = {bm.items[b][j].key for b, j in ((1, 0), (2, 1), (3, 1), (4, 0), (6, 1))}
    assert len(xs) == 1 and bm.items[5][1].key == bm.items[4][1].key != bm.items[2][1].key


@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
def test_packed_media_match_every_rows_own(sharing):
    rows, batch, bm, pos, plan, packed = _setup(sharing)
    where = _scattered(plan, packed, batch, rows)
    # the predicted tokens are the real ids: a response's placeholders are targets too
    real = batch["input_ids"][plan.out_row, plan.S - plan.R + plan.out_col]
    assert torch.equal(plan.target_ids, real) and int(plan.target_ids.max()) < 128
    assert (plan.target_ids == IMAGE).sum() == sum(r.response.count(IMAGE) for r in rows) > 0
    assert torch.equal(plan.input_ids, batch["input_ids"].reshape(-1)[plan.source_index])
    # positions: every row's own at each of its tokens, prompt and response
    full = plan.full_index()
    am = batch["attention_mask"].bool()
    assert torch.equal(packed.position_ids[:, 0][:, full[am]], pos[:, am])
    if sharing == "prompt":
        # the unique prompts' images once (A's a, B's b), every response's own once, in its response segment, in
        # placeholder order
        assert plan.G == 3 and (packed.items, packed.response_items, packed.row_items) == (9, 7, 12)
        for b, row in enumerate(rows):
            seg = range(int(plan.response_start[b]), int(plan.response_start[b] + plan.response_lens[b]))
            prompt_items = [it for it in bm.items[b] if not it.in_response]
            own = [where[(b, j)] for j, it in enumerate(bm.items[b]) if it.in_response]
            assert own == sorted(own) and len(set(own)) == len(own)
            for it in bm.items[b]:
                at = full[b, it.cols]
                assert all(int(t) in seg for t in at) == it.in_response
            # a response item is no other row's: rows 2 and 6 (same group, same pixels x) get separate copies
            others = {where[(c, j)] for c in range(len(rows)) if c != b for j, _ in enumerate(bm.items[c])}
            assert not set(own) & others
            assert len(prompt_items) == (0 if row.media is None or b in (1, 4) else 1)
        assert where[(0, 0)] == where[(2, 0)] == where[(5, 0)] == where[(6, 0)] != where[(3, 0)]
    else:
        # the tree: rows 2 and 6 share [32, x] below A's prompt, rows 1 and 4 share [40, x] below T's; row 3's x2 is
        # below B's prompt (another node), row 5's y and row 4's y are in different subtrees
        assert where[(2, 1)] == where[(6, 1)] and where[(1, 0)] == where[(4, 0)]
        assert len({where[(2, 1)], where[(1, 0)], where[(3, 1)]}) == 3 and where[(5, 1)] != where[(4, 1)]
        assert (packed.items, packed.response_items, packed.row_items) == (7, 5, 12)
    # the packed order is the placeholders' order in the packed row (what the model scatters by)
    order = [k for _, k in sorted((int(full[b, bm.items[b][j].cols[0]]), k) for (b, j), k in where.items())]
    assert list(dict.fromkeys(order)) == list(range(packed.items))


def test_identical_response_images_in_a_group():
    """Two rows of one group with the same response (tokens and tool image, the image in separate tensors): with
    prompt sharing each response's image is its own (encoded twice); the prefix tree holds the response once."""
    a, x = image(1), image(21)
    x2 = (x[0].clone(), x[1].clone())
    rows = [agent_row([[1, 2], a, [3]], [[30], x, [31]]), agent_row([[1, 2], a, [3]], [[30], x2, [31]])]
    batch = vlm_batch(rows)
    ids, am, R = batch["input_ids"], batch["attention_mask"], batch["responses"].shape[1]
    pos = _positions(batch_media(ids, am, R, batch["media"], TOKENS).keyed_ids, am)
    for sharing, kw, items in (("prompt", {}, 3), ("prefix", {"min_shared_len": 1}, 2)):
        plan, packed = build_media_plan(ids, am, R, batch["media"], TOKENS, pos, sharing=sharing, **kw)
        where = _scattered(plan, packed, batch, rows)
        assert packed.items == items and packed.row_items == 4 and where[(0, 0)] == where[(1, 0)]
        assert (where[(0, 1)] == where[(1, 1)]) == (sharing == "prefix")


def test_check_shared_positions_covers_response_images():
    """Before the ranks agree: rows that share tokens and images (a response's included, for the prefix tree) must
    have equal positions on them; a prompt plan shares prompts only."""
    rows, batch, bm, pos, *_ = _setup("prompt")
    am = batch["attention_mask"]
    lengths, p = am.sum(1), am[:, :am.shape[1] - batch["responses"].shape[1]].sum(1)
    check_shared_positions(bm.keyed_ids, lengths, pos, shared_cap=p)
    check_shared_positions(bm.keyed_ids, lengths, pos)
    bad = pos.clone()
    col = bm.items[6][1].cols[-1]  # row 6's last placeholder of x: [32, x] is shared with row 2 in the tree
    bad[1, 6, col] += 1
    check_shared_positions(bm.keyed_ids, lengths, bad, shared_cap=p)  # prompt sharing: responses are not shared
    with pytest.raises(ValueError, match="rows 2 and 6 share their first|rows 6 and 2 share their first"):
        check_shared_positions(bm.keyed_ids, lengths, bad)


def test_bad_response_media_refused_by_name():
    rows = _rows()
    batch = vlm_batch(rows)
    ids, am, R = batch["input_ids"], batch["attention_mask"], batch["responses"].shape[1]

    # a response placeholder count that does not match the row's grids
    bad = ids.clone()
    first = int(torch.nonzero(bad[1] == IMAGE)[0, 0])
    bad[1, first] = 50
    with pytest.raises(ValueError, match=r"media\[1\]: 3 image placeholder tokens and 16 patch rows of pixel_values, "
                                         r"but image_grid_thw \[\[1, 4, 4\]\] gives 4 tokens"):
        batch_media(bad, am, R, batch["media"], TOKENS)
    # an image whose placeholders straddle the prompt / response split
    with pytest.raises(ValueError, match=r"media\[1\]: image 0 of the row has placeholder tokens \(id 120\) in both "
                                         r"the prompt and the response"):
        cols = torch.nonzero(ids[1] == IMAGE)[:, 0]
        batch_media(ids, am, ids.shape[1] - int(cols[1]), batch["media"], TOKENS)
    # a split outside the row
    with pytest.raises(ValueError, match=r"response_width: expected 0 <= response_width <= S = "):
        batch_media(ids, am, ids.shape[1] + 1, batch["media"], TOKENS)
