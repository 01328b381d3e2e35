"""Group-aware batching for OpenRLHF (docs/design/openrlhf.md): a prompt's samples share micro-batches, and every
optimizer step trains on exactly the samples stock OpenRLHF gives it (by default).

Stock OpenRLHF 0.11 (``ActorPPOTrainer.ppo_train``): each DP rank's replay buffer holds single samples; its
``DataLoader`` (``RandomSampler`` seeded from torch's global generator, ``batch_size = --train.micro_batch_size``,
``drop_last``) draws a new permutation every epoch; ``iter_grad_accum_global_norm`` groups ``accumulated_gradient``
consecutive micro-batches into one optimizer step and gives every micro-batch of the step the same loss normalisers
(action tokens / samples summed over the step and all DP ranks). A step's gradient is therefore a sum over its samples
that does not depend on how they are cut into micro-batches. Two modes (``group_balance_mode``):

* ``keep_minibatches`` (default, exact): the stock ``DataLoader`` runs untouched (same permutation, same draws from
  torch's generator); each step's micro-batches are regrouped only among themselves (:func:`regroup_micro_batches`:
  the same count and sizes, a group's samples of that step together where sizes allow) and keep the step's stock
  normalisers. Composition follows the stock permutation (groups visited in order of first appearance), so it is
  random, drawn from the run's seed, and new every epoch, with no extra random draw.
* ``whole_groups`` (opt-in, warned once): each epoch's micro-batches (the stock sampler's samples) are repacked with
  whole groups in order of first appearance in the stock permutation, and the normalisers recomputed by OpenRLHF's
  own ``iter_grad_accum_global_norm`` over the new steps: more deduplication, but other samples share a step.

With ``--train.dynamic_batch_enable`` stock neither shuffles nor draws: the DP balancing (:func:`balance_experiences`)
reproduces stock's rank assignment and then moves samples between ranks only among positions that feed the same
optimizer steps (actor's and critic's); each step's window is re-partitioned by deduplicated cost on the actor
(:func:`regroup_dynamic_batch`); the critic's buffer is left stock. The experience maker's dynamic micro-batches count
their budget in raw tokens whenever a model that runs the stock forward (critic, reward model) reads them.

Groups come from the prompt tokens (:func:`sample_groups`), never from the ``prompts`` strings.
"""

from __future__ import annotations

import itertools
import logging
from typing import Optional

import torch

from zorro_verl.integrations.openrlhf.layout import verl_layout
from zorro_verl.packing import group_ids
from zorro_verl.packing.microbatch import balance_groups_across_ranks, dynamic_microbatches, split_to_count

__all__ = ["MODES", "sample_groups", "pack_in_order", "group_microbatches", "regroup_micro_batches",
           "grouped_grad_accum", "install_training_batches", "dynamic_partitions", "install_replay_buffer",
           "regroup_dynamic_batch", "split_rollout_samples", "stock_rank_order", "balance_experiences",
           "balance_whole_groups", "make_balance_experiences", "warn_micro_batch_sizes", "pop_split_counts",
           "GroupBatches"]

logger = logging.getLogger(__name__)

#: ``group_balance_mode`` values (the verl setting's, with the same meaning).
MODES = ("keep_minibatches", "whole_groups")

#: Groups cut in this process since the last :func:`pop_split_counts`: ``train`` (training micro-batches of the
#: actor), ``balance`` (dynamic batching's DP balancing, in the trainer process).
_SPLIT = {"train": 0, "balance": 0}


def pop_split_counts() -> dict:
    """``{"train": int, "balance": int}`` groups cut since the last call (then reset)."""
    out = dict(_SPLIT)
    _SPLIT.update(dict.fromkeys(_SPLIT, 0))
    return out


def sample_groups(sequences: torch.Tensor, attention_mask: torch.Tensor,
                  action_mask: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    """``(row_group, prompt_lens, response_lens)`` per row of a padded OpenRLHF batch (as host lists).

    Args: ``sequences [B, T] int64``, ``attention_mask [B, T]``, ``action_mask [B, A]`` (OpenRLHF's layout,
    :mod:`.layout`). Rows with the same valid prompt tokens share a group id (numbered by first appearance).
    """
    ids, valid, R, sp, _ = verl_layout(sequences, attention_mask, action_mask)
    Pw = ids.shape[1] - R
    g = group_ids(ids[:, :Pw], valid[:, :Pw])
    g, p, r = torch.stack([g, sp.p, sp.r]).tolist()
    return g, p, r


def _rows(t: torch.Tensor) -> list[torch.Tensor]:
    return [t] if t.dim() == 1 else list(t)


def _items_groups(items) -> tuple[list[int], list[int], list[int]]:
    """Groups of the rows of ``Experience`` items (the replay buffer's single samples ``[L]``, or rollout samples
    ``[b, L]``), in item order. Only ``sequences``, ``attention_mask`` and ``action_mask`` are padded (right, as
    OpenRLHF's ``zero_pad_sequences``), never the other fields."""
    pad = torch.nn.utils.rnn.pad_sequence
    seq = pad([row for it in items for row in _rows(it.sequences)], batch_first=True)
    am = pad([row for it in items for row in _rows(it.attention_mask)], batch_first=True)
    act = pad([row for it in items for row in _rows(it.action_mask)], batch_first=True)
    # action column j marks token j + (T_item - A_item): right padding keeps OpenRLHF's A = T - 1 alignment
    if act.shape[1] != seq.shape[1] - 1:
        act = torch.nn.functional.pad(act, (0, seq.shape[1] - 1 - act.shape[1]))
    return sample_groups(seq, am, act)


class GroupBatches:
    """Row-index micro-batches plus the count of groups they split (``split_groups``)."""

    def __init__(self, batches: list[list[int]], split_groups: int):
        self.batches = batches
        self.split_groups = split_groups

    def __len__(self) -> int:
        return len(self.batches)


def pack_in_order(row_group, prompt_lens, response_lens, sizes) -> GroupBatches:
    """Rows into ``len(sizes)`` micro-batches of exactly ``sizes[k]`` rows (``sum(sizes) == B``), a group's rows
    together where sizes allow.

    Groups are visited in order of first appearance in the rows (so the caller's order, e.g. the stock sampler's
    permutation, decides the composition) and each goes whole onto the least-loaded micro-batch (deduplicated cost)
    with room for it; groups that fit nowhere whole are then cut into as few pieces as possible, filling the
    micro-batches with the most free rows first (``split_groups`` counts them). Rows of a micro-batch come out in
    input order.
    """
    g, p, r = list(row_group), list(prompt_lens), list(response_lens)
    sizes = list(sizes)
    if sum(sizes) != len(g) or any(s < 0 for s in sizes):
        raise ValueError(f"sizes: expected non-negative micro-batch sizes summing to the {len(g)} rows, got {sizes}.")
    units: dict[int, list[int]] = {}
    for b, gid in enumerate(g):
        units.setdefault(gid, []).append(b)
    n = len(sizes)
    bins: list[list[int]] = [[] for _ in range(n)]
    loads = [0] * n
    deferred = []
    for rows in units.values():
        fits = [k for k in range(n) if sizes[k] - len(bins[k]) >= len(rows)]
        if not fits:
            deferred.append(rows)
            continue
        k = min(fits, key=lambda k: (loads[k], k))
        bins[k].extend(rows)
        loads[k] += p[rows[0]] + sum(r[b] for b in rows)
    split = 0
    for rows in deferred:
        split += 1
        while rows:
            k = max(range(n), key=lambda k: (sizes[k] - len(bins[k]), -loads[k], -k))
            free = sizes[k] - len(bins[k])
            piece, rows = rows[:free], rows[free:]
            bins[k].extend(piece)
            loads[k] += p[piece[0]] + sum(r[b] for b in piece)
    return GroupBatches([sorted(rows) for rows in bins], split)


def group_microbatches(row_group, prompt_lens, response_lens, micro_batch_size: int,
                       generator: Optional[torch.Generator] = None) -> GroupBatches:
    """``B // micro_batch_size`` micro-batches of exactly ``micro_batch_size`` rows (the stock ``drop_last`` count),
    groups together where sizes allow (:func:`pack_in_order`). Groups are visited in a random order drawn from
    ``generator``, or (None) in order of first appearance, which draws nothing; the ``B % micro_batch_size`` rows
    left over are the last ones of that order."""
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size: expected a positive int, got {micro_batch_size!r}.")
    g = list(row_group)
    count = len(g) // micro_batch_size
    if count == 0:
        return GroupBatches([], 0)
    first: dict[int, int] = {}
    for gid in g:
        first.setdefault(gid, len(first))
    rank = (torch.randperm(len(first), generator=generator).tolist() if generator is not None
            else list(range(len(first))))
    order = sorted(range(len(g)), key=lambda b: (rank[first[g[b]]], b))[: count * micro_batch_size]
    gb = pack_in_order([g[b] for b in order], [prompt_lens[b] for b in order], [response_lens[b] for b in order],
                       [micro_batch_size] * count)
    return GroupBatches([sorted(order[i] for i in rows) for rows in gb.batches], gb.split_groups)


# ---------------------------------------------------------------------------------------------- training steps
def _single_items(experiences) -> list:
    """The single samples of collated micro-batches, unpadded as the replay buffer stores them."""
    from openrlhf.trainer.ppo_utils.experience import remove_padding_in_sequences, split_experience_batch

    return [it for e in experiences for it in remove_padding_in_sequences(split_experience_batch(e))]


def regroup_micro_batches(experiences: list, packing_samples: bool = False) -> tuple[list, int]:
    """The samples of ``experiences`` (collated ``Experience`` micro-batches, e.g. one optimizer step's) recut into
    as many micro-batches of the same sizes (:func:`pack_in_order` in their current order). Returns the new
    ``Experience`` batches (OpenRLHF's ``make_experience_batch``) and the groups cut."""
    from openrlhf.trainer.ppo_utils.experience import make_experience_batch

    items = _single_items(experiences)
    g, p, r = _items_groups(items)
    gb = pack_in_order(g, p, r, [len(e.sequences) for e in experiences])
    return [make_experience_batch([items[i] for i in rows], packing_samples) for rows in gb.batches], gb.split_groups


def grouped_grad_accum(stock, mode: str = "keep_minibatches"):
    """Wrap OpenRLHF's ``iter_grad_accum_global_norm(data_iter, strategy, accumulated_gradient, mask_fn)`` (which
    yields ``(micro_batch, loss_batch_info)``, one ``loss_batch_info`` per optimizer step) so that micro-batches
    keep groups together (module docstring: the two modes). Groups cut are counted in :func:`pop_split_counts`."""
    if mode not in MODES:
        raise ValueError(f"group_balance_mode: expected one of {list(MODES)}, got {mode!r}.")

    def iter_grouped(data_iter, strategy, accumulated_gradient, mask_fn):
        packing = bool(getattr(getattr(getattr(strategy, "args", None), "ds", None), "packing_samples", False))
        if mode == "whole_groups":
            exps = list(data_iter)  # the epoch's micro-batches, as stock's sampler drew them
            if exps:
                exps, split = regroup_micro_batches(exps, packing)
                _SPLIT["train"] += split
            yield from stock(iter(exps), strategy, accumulated_gradient, mask_fn)
            return
        gas = max(int(accumulated_gradient), 1)
        steps = stock(data_iter, strategy, accumulated_gradient, mask_fn)
        while True:
            window = list(itertools.islice(steps, gas))  # one optimizer step (stock's windows are gas long)
            if not window:
                return
            info = window[0][1]
            if any(i is not info for _, i in window):
                raise RuntimeError("zorro: OpenRLHF's iter_grad_accum_global_norm gave one optimizer step several "
                                   "loss normalisers; this OpenRLHF version's gradient accumulation is not the one "
                                   "zorro's batching was built for. Set group_balance=false in "
                                   "ZORRO_OPENRLHF_OPTIONS.")
            if len(window) == 1:
                yield window[0]
                continue
            exps, split = regroup_micro_batches([e for e, _ in window], packing)
            _SPLIT["train"] += split
            for e in exps:
                yield e, info

    iter_grouped.__wrapped__ = stock
    return iter_grouped


def install_training_batches(ppo_actor_module, settings) -> None:
    """Group the actor's training micro-batches (``openrlhf.trainer.ray.ppo_actor``; idempotent): its
    ``iter_grad_accum_global_norm`` -> :func:`grouped_grad_accum`, and ``ActorPPOTrainer.ppo_train`` marks the
    trainer's replay buffer for :func:`regroup_dynamic_batch` (the critic's, run by the stock forward, stays stock).
    ``whole_groups`` is warned once, at the first training step."""
    if not settings.group_balance:
        return
    mod = ppo_actor_module
    if not getattr(mod.iter_grad_accum_global_norm, "_zorro", False):
        grouped = grouped_grad_accum(mod.iter_grad_accum_global_norm, settings.group_balance_mode)
        grouped._zorro = True
        mod.iter_grad_accum_global_norm = grouped
    cls = mod.ActorPPOTrainer
    if getattr(cls.ppo_train, "_zorro_batches", False):
        return
    ppo_train = cls.ppo_train
    mode = settings.group_balance_mode

    def wrapped(self, *args, **kwargs):
        self.replay_buffer.zorro_regroup = True
        if mode == "whole_groups" and not getattr(cls, "_zorro_warned_mode", False):
            cls._zorro_warned_mode = True
            logger.warning("zorro: group_balance_mode=whole_groups: training micro-batches hold whole prompt groups, "
                           "so other samples share an optimizer step than in a stock run (a different, equally "
                           "valid run). Remove it from ZORRO_OPENRLHF_OPTIONS for stock's steps.")
        return ppo_train(self, *args, **kwargs)

    wrapped.__wrapped__ = ppo_train
    wrapped._zorro_batches = True
    cls.ppo_train = wrapped


def dynamic_partitions(row_group, prompt_lens, response_lens, max_tokens: int, count: int = 1,
                       raw_lens=None) -> GroupBatches:
    """Micro-batches of at most ``max_tokens`` tokens (whole groups packed first-fit-decreasing), split to at least
    ``count`` (e.g. the DP-wide maximum). The budget counts deduplicated tokens, or with ``raw_lens`` (``[B]`` valid
    tokens per row) raw tokens: what a model running the stock forward processes."""
    if raw_lens is not None:
        prompt_lens, response_lens = [0] * len(raw_lens), list(raw_lens)
    mbs = dynamic_microbatches(row_group, prompt_lens, response_lens, max_tokens)
    if len(mbs) < count:
        mbs = split_to_count(mbs, count, row_group, prompt_lens, response_lens)
    return GroupBatches([list(b) for b in mbs.batches], mbs.split_groups)


# ---------------------------------------------------------------------------------------------- replay buffer
def regroup_dynamic_batch(buffer, strategy) -> None:
    """After OpenRLHF's ``setup_dynamic_batch``: replace each optimizer step's length-balanced partition of its
    window (``local_train_batch_size`` consecutive samples) by :func:`dynamic_partitions` on deduplicated cost under
    ``--train.max_tokens_per_gpu``, with the partition count all-reduced (max) over DP ranks as OpenRLHF does.

    Kept from OpenRLHF's computation: the steps and their windows, and each step's loss normalisers
    (``dynamic_batch_num_tokens`` / ``dynamic_global_batch_size``: sums over the window, independent of the
    partition). Recomputed per partition as OpenRLHF defines them: ``dynamic_sample_loss_scale = len(part) /
    window`` and ``dynamic_optimizer_step`` (1 on a step's last partition).
    """
    steps, start = [], 0
    flags = buffer.dynamic_optimizer_step
    for k, last in enumerate(flags):  # the stock step boundaries
        if last:
            steps.append((start, k + 1))
            start = k + 1
    if not steps:
        return
    windows = [sorted(i for part in buffer.dynamic_indices[a:b] for i in part) for a, b in steps]
    g, p, r = _items_groups(buffer.items)
    budget = strategy.args.train.max_tokens_per_gpu
    parts = [dynamic_partitions([g[i] for i in w], [p[i] for i in w], [r[i] for i in w], budget) for w in windows]
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    counts = strategy.all_reduce(torch.tensor([len(x) for x in parts], dtype=torch.int, device=device), op="max")
    indices, scales, tokens, sizes, opt = [], [], [], [], []
    split = 0
    for (a, _), w, mbs, count in zip(steps, windows, parts, counts.tolist()):
        if count > len(mbs):
            mbs = dynamic_partitions([g[i] for i in w], [p[i] for i in w], [r[i] for i in w], budget, count)
        split += mbs.split_groups
        for j, rows in enumerate(mbs.batches):
            indices.append([w[i] for i in rows])
            scales.append(len(rows) / len(w))
            tokens.append(buffer.dynamic_batch_num_tokens[a])
            sizes.append(buffer.dynamic_global_batch_size[a])
            opt.append(int(j == len(mbs.batches) - 1))
    buffer.dynamic_indices, buffer.dynamic_sample_loss_scale = indices, scales
    buffer.dynamic_batch_num_tokens, buffer.dynamic_global_batch_size = tokens, sizes
    buffer.dynamic_optimizer_step = opt
    _SPLIT["train"] += split


def install_replay_buffer(cls) -> None:
    """``NaiveReplayBuffer.setup_dynamic_batch`` followed by :func:`regroup_dynamic_batch` on the buffers marked
    ``zorro_regroup`` (the actor's, by :func:`install_training_batches`); idempotent. Without dynamic batching the
    buffer is stock: its ``DataLoader`` draws stock's permutation and the regrouping happens per optimizer step
    (:func:`grouped_grad_accum`)."""
    if getattr(cls, "_zorro_installed", False):
        return
    setup_dynamic = cls.setup_dynamic_batch

    def new_setup_dynamic_batch(self, strategy):
        setup_dynamic(self, strategy)
        if getattr(self, "zorro_regroup", False):
            regroup_dynamic_batch(self, strategy)

    new_setup_dynamic_batch.__wrapped__ = setup_dynamic
    cls.setup_dynamic_batch = new_setup_dynamic_batch
    cls._zorro_installed = True


# ---------------------------------------------------------------------------------------------- experience maker
def _rollout_n(args) -> int:
    return int(getattr(getattr(args, "rollout", None), "n_samples_per_prompt", 1) or 1)


def _dp_size(args, role: str = "actor") -> int:
    group = getattr(args, role)
    return group.num_nodes * group.num_gpus_per_node // args.ds.ring_attn_size // args.ds.tensor_parallel_size


_WARNED_SIZES: set = set()


def warn_micro_batch_sizes(args) -> list:
    """Warn once per process for each fixed micro-batch size (``--rollout.micro_batch_size``,
    ``--train.micro_batch_size``) that is not a multiple of ``--rollout.n_samples_per_prompt``: such micro-batches
    cut prompt groups (OpenRLHF's default of 1 deduplicates nothing). Returns the flags warned about."""
    n = _rollout_n(args)
    if n <= 1 or getattr(getattr(args, "train", None), "dynamic_batch_enable", False):
        return []
    out = []
    for flag, group in (("--rollout.micro_batch_size", "rollout"), ("--train.micro_batch_size", "train")):
        size = getattr(getattr(args, group, None), "micro_batch_size", None)
        if size is None or size % n == 0:
            continue
        out.append(flag)
        if flag not in _WARNED_SIZES:
            _WARNED_SIZES.add(flag)
            logger.warning("zorro: %s %d is not a multiple of --rollout.n_samples_per_prompt %d: its micro-batches "
                           "cut prompt groups and each piece recomputes its prompt (%s). Use a multiple of n; "
                           "zorro/split_groups and zorro/experience_split_groups count the cuts.", flag, size, n,
                           "nothing is deduplicated" if size == 1 else "less is deduplicated")
    return out


def split_rollout_samples(self, rollout_samples):
    """``RemoteExperienceMaker.split_rollout_samples`` that keeps groups whole (replaces the method).

    Fixed micro-batches (``--rollout.micro_batch_size``) are OpenRLHF's contiguous chunks (the n samples of a prompt
    arrive together; the order also decides which DP rank trains them): groups stay whole when the size is a
    multiple of ``n_samples_per_prompt``; otherwise warned once and counted (``zorro_split_groups``). With dynamic
    batching the length-balanced partition is replaced by :func:`dynamic_partitions` (whole groups) under
    ``--rollout.max_tokens_per_gpu``, counted in deduplicated tokens when only zorro's models (actor, reference) read
    the micro-batches and in raw tokens when a critic or a reward model (the stock forward) reads them too; the count
    is rounded up to a multiple of the actor's DP size.
    """
    from openrlhf.trainer.ppo_utils.experience import Experience

    args = self.args
    for i, sample in enumerate(rollout_samples):
        sample.index = [i]
    pad = self.tokenizer.pad_token_id
    n = _rollout_n(args)
    if not args.train.dynamic_batch_enable:
        size = args.rollout.micro_batch_size
        warn_micro_batch_sizes(args)
        out = [Experience.concat_experiences(rollout_samples[i: i + size], pad)
               for i in range(0, len(rollout_samples), size)]
        self.zorro_split_groups = getattr(self, "zorro_split_groups", 0) + sum(
            1 for i in range(size, len(rollout_samples), size) if n > 1 and i % n)
        return out
    g, p, r = _items_groups(rollout_samples)
    stock_readers = getattr(self, "critic_model_group", None) is not None or \
        getattr(self, "reward_model_group", None) is not None
    raw = [int(s.attention_mask.sum()) for s in rollout_samples] if stock_readers else None
    dp = _dp_size(args)
    budget = args.rollout.max_tokens_per_gpu
    mbs = dynamic_partitions(g, p, r, budget, raw_lens=raw)
    count = -(-max(len(mbs), dp) // dp) * dp  # a multiple of the DP size: each rank gets the same number
    if count > len(mbs):
        mbs = dynamic_partitions(g, p, r, budget, count, raw_lens=raw)
    self.zorro_split_groups = getattr(self, "zorro_split_groups", 0) + mbs.split_groups
    return [Experience.concat_experiences([rollout_samples[i] for i in rows], pad) for rows in mbs.batches]


# ---------------------------------------------------------------------------------------------- DP balancing
def stock_rank_order(lengths, dp: int) -> list[list[int]]:
    """OpenRLHF 0.11's ``balance_experiences`` on indices: items (in the given order, ``lengths`` their
    ``total_length``) sorted longest first (stable), cut into chunks of ``dp``, the second half's chunks reversed and
    interleaved with the first half's; rank ``k`` gets the ``k``-th item of every chunk. Returns each rank's item
    indices in order."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep their order, as stock
    chunks = [order[i: i + dp] for i in range(0, len(order), dp)]
    half = len(chunks) // 2
    first, last = chunks[:half], [c[::-1] for c in chunks[half:]]
    inter = []
    for i in range(half):
        inter.append(first[i])
        inter.append(last[-(i + 1)])
    if len(last) > len(first):
        inter.append(last[0])
    ranks = [[c[k] for c in inter if k < len(c)] for k in range(max((len(c) for c in inter), default=0))]
    return [rows for rows in ranks if rows]


def _stock_maker_order(lengths_by_pos: list[int], args) -> list[int]:
    """The rollout positions in the order stock's dynamic ``split_rollout_samples`` hands them on (its
    length-balanced micro-batches one after another)."""
    from openrlhf.utils.seqlen_balancing import get_minimum_num_micro_batch_size, get_seqlen_balanced_partitions

    dp = _dp_size(args)
    minimum = get_minimum_num_micro_batch_size(lengths_by_pos, args.rollout.max_tokens_per_gpu,
                                               args.ds.ring_attn_size, args.ds.tensor_parallel_size)
    num = max(minimum // dp * dp, dp)
    return [i for part in get_seqlen_balanced_partitions(lengths_by_pos, num, False) for i in part]


def _step_slots(rank_lens: list[int], args) -> list[list]:
    """Per actor rank, per position: the optimizer steps it feeds, ``(actor step, critic step)`` (``None`` where
    the position trains in no step). Stock (``setup_dynamic_batch``): a rank's buffer is its items in order; step
    ``k`` is positions ``[k L, (k + 1) L)`` with ``L = --train.batch_size // dp``, for ``min(expected, min_rank
    len // L)`` steps. The critic (when there is one) receives the actor ranks' batches in contiguous chunks over its
    own ranks (``RayActorGroup.async_run_method_batch``) and cuts its steps the same way with its own DP size."""
    def steps_of(lens: list[int], dp: int) -> list[list]:
        L = args.train.batch_size // dp
        expected = args.rollout.batch_size * _rollout_n(args) // args.train.batch_size
        num = min([expected] + [x // L for x in lens]) if L else 0
        return [[j // L if j // L < num else None for j in range(x)] for x in lens]

    actor = steps_of(rank_lens, len(rank_lens))
    if not getattr(getattr(args, "critic", None), "model_name_or_path", None):
        return [[(a, None) for a in rows] for rows in actor]
    dpc = _dp_size(args, "critic")
    size = -(-len(rank_lens) // dpc)
    chunks = [list(range(q * size, min((q + 1) * size, len(rank_lens)))) for q in range(dpc)]
    chunks = [c for c in chunks if c]
    critic_steps = steps_of([sum(rank_lens[k] for k in c) for c in chunks], len(chunks))
    critic = [None] * len(rank_lens)
    for c, steps in zip(chunks, critic_steps):
        off = 0
        for k in c:
            critic[k] = steps[off: off + rank_lens[k]]
            off += rank_lens[k]
    return [list(zip(a, c)) for a, c in zip(actor, critic)]


def balance_experiences(experiences, args):
    """``balance_experiences`` (dynamic batching: one ``Experience`` per DP rank) with stock's optimizer steps.

    Stock's assignment (:func:`stock_rank_order` over the samples in the order stock's experience maker would have
    produced them, recomputed from ``Experience.index`` and the lengths) fixes which positions feed which optimizer
    step, for the actor and the critic; samples then move between ranks only among positions that feed the same
    steps (:func:`pack_in_order` onto those positions, a group together where the counts allow; every rank keeps
    its row count). So every step trains on stock's samples and every loss normaliser (a sum over the step) is
    stock's. Groups cut across ranks are counted (:func:`pop_split_counts`)."""
    from openrlhf.trainer.ppo_utils.experience import make_experience_batch, split_experience_batch

    pos = [i for e in experiences for i in (e.index or [])]
    items = [it for e in experiences for it in split_experience_batch(e)]
    if len(pos) != len(items) or sorted(pos) != list(range(len(items))):
        raise RuntimeError("zorro: the experiences lost their rollout positions (Experience.index), which zorro needs "
                           "to reproduce OpenRLHF's DP balancing; set group_balance=false in ZORRO_OPENRLHF_OPTIONS.")
    at = {p: k for k, p in enumerate(pos)}  # rollout position -> item
    lengths = [0] * len(items)
    for k, p in enumerate(pos):
        lengths[p] = int(items[k].total_length.item())
    order = [at[p] for p in _stock_maker_order(lengths, args)]  # items as stock's maker orders them
    ranks = [[order[i] for i in rows] for rows in
             stock_rank_order([float(items[k].total_length.item()) for k in order], _dp_size(args))]
    g, p_, r = _items_groups(items)
    slots = _step_slots([len(rows) for rows in ranks], args)
    where: dict = {}
    for k, rank_slots in enumerate(slots):
        for j, slot in enumerate(rank_slots):
            if slot != (None, None):
                where.setdefault(slot, []).append((k, j))
    split = 0
    for places in where.values():
        rows = [ranks[k][j] for k, j in places]
        sizes = [sum(1 for k, _ in places if k == q) for q in range(len(ranks))]
        gb = pack_in_order([g[b] for b in rows], [p_[b] for b in rows], [r[b] for b in rows], sizes)
        split += gb.split_groups
        for q, part in enumerate(gb.batches):
            for (k, j), i in zip([pl for pl in places if pl[0] == q], part):
                ranks[k][j] = rows[i]
    _SPLIT["balance"] += split
    return [make_experience_batch([items[b] for b in rows]) for rows in ranks]


def balance_whole_groups(experiences, args):
    """``whole_groups`` mode: ``balance_groups_across_ranks`` on the deduplicated cost, equal row counts per rank
    (``B // dp``, the first ``B % dp`` one more, as OpenRLHF's interleaving gives); which samples share a step
    differs from stock."""
    from openrlhf.trainer.ppo_utils.experience import make_experience_batch, split_experience_batch

    items = [it for e in experiences for it in split_experience_batch(e)]
    g, p, r = _items_groups(items)
    bal = balance_groups_across_ranks(g, p, r, _dp_size(args), equal_size=True)
    _SPLIT["balance"] += bal.split_groups
    return [make_experience_batch([items[b] for b in rows]) for rows in bal.ranks if rows]


def make_balance_experiences(mode: str = "keep_minibatches"):
    """The ``balance_experiences`` replacement for ``group_balance_mode``."""
    if mode not in MODES:
        raise ValueError(f"group_balance_mode: expected one of {list(MODES)}, got {mode!r}.")
    return balance_experiences if mode == "keep_minibatches" else balance_whole_groups
