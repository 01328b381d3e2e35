"""Group-aware batching for OpenRLHF (docs/DESIGN.md §12): keep a prompt's samples in one micro-batch.

OpenRLHF's replay buffer holds single samples; its training ``DataLoader`` shuffles them one by one
(``micro_train_batch_size`` rows per micro-batch), and with ``--train.dynamic_batch_enable`` the experience maker,
the DP balancing and the buffer partition samples by length. Each of those scatters a prompt's n samples, and a group
split over m micro-batches pays its prompt m times. The replacements here pack **whole groups** with
``zorro_verl.packing`` (cost = each prompt once + every response, §6) and change nothing else:

* :func:`group_microbatches` — exactly ``micro_train_batch_size`` rows per micro-batch and ``B // size``
  micro-batches (the stock ``drop_last`` count), so gradient-accumulation windows and OpenRLHF's loss normalisation
  (token-mean over each optimizer step's window, computed by OpenRLHF from the micro-batches) are unchanged; the
  group order is drawn at random (torch's generator, as the stock ``RandomSampler``), the ``DataLoader`` then
  shuffles the micro-batches: group-level instead of sample-level shuffling.
* :func:`dynamic_partitions` — dynamic batching on the deduplicated token cost (``dynamic_microbatches``), the same
  micro-batch count on every DP rank (``split_to_count``).
* :func:`install_replay_buffer`, :func:`split_rollout_samples`, :func:`balance_experiences` — the seams.

Groups come from the prompt tokens (:func:`sample_groups`), never from the ``prompts`` strings.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from zorro_verl.integrations.openrlhf.layout import verl_layout
from zorro_verl.packing import group_ids
from zorro_verl.packing.microbatch import balance_groups_across_ranks, dynamic_microbatches, split_to_count

__all__ = ["sample_groups", "group_microbatches", "dynamic_partitions", "install_replay_buffer",
           "regroup_dynamic_batch", "split_rollout_samples", "balance_experiences", "GroupBatches"]

logger = logging.getLogger(__name__)


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


def group_microbatches(row_group, prompt_lens, response_lens, micro_batch_size: int,
                       generator: Optional[torch.Generator] = None) -> GroupBatches:
    """``B // micro_batch_size`` micro-batches of exactly ``micro_batch_size`` rows, groups kept whole where sizes
    allow (``balance_groups_across_ranks`` with one "rank" per micro-batch: whole groups first, balanced by
    deduplicated cost; a group that fits nowhere whole is cut into as few pieces as possible and counted).

    The groups are visited in a random order drawn from ``generator`` (torch's default one if None); the
    ``B % micro_batch_size`` rows left over (OpenRLHF's ``drop_last``) are the last ones of that order.
    """
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size: expected a positive int, got {micro_batch_size!r}.")
    g = list(row_group)
    B = len(g)
    count = B // micro_batch_size
    if count == 0:
        return GroupBatches([], 0)
    G = max(g) + 1
    rank = torch.randperm(G, generator=generator).tolist()  # random position of each group
    order = sorted(range(B), key=lambda b: (rank[g[b]], b))[: count * micro_batch_size]  # rows, group-major
    bal = balance_groups_across_ranks([g[b] for b in order], [prompt_lens[b] for b in order],
                                      [response_lens[b] for b in order], count, equal_size=True)
    batches = [sorted(order[i] for i in rows) for rows in bal.ranks]
    return GroupBatches(batches, bal.split_groups)


def dynamic_partitions(row_group, prompt_lens, response_lens, max_tokens: int, count: int = 1) -> GroupBatches:
    """Micro-batches of at most ``max_tokens`` deduplicated tokens (whole groups packed first-fit-decreasing), split
    to at least ``count`` (e.g. the DP-wide maximum)."""
    mbs = dynamic_microbatches(row_group, prompt_lens, response_lens, max_tokens)
    if len(mbs) < count:
        mbs = split_to_count(mbs, count, row_group, prompt_lens, response_lens)
    return GroupBatches([list(b) for b in mbs.batches], mbs.split_groups)


# ---------------------------------------------------------------------------------------------- replay buffer
def _buffer_batches(self) -> GroupBatches:
    """The buffer's group micro-batches, built once after the last ``append`` / ``clear``."""
    gb = self.__dict__.get("_zorro_batches")
    if gb is None:
        if self.items:
            g, p, r = _items_groups(self.items)
            gb = group_microbatches(g, p, r, self._zorro_micro_batch_size)
        else:
            gb = GroupBatches([], 0)
        self._zorro_batches = gb
        self.zorro_split_groups = getattr(self, "zorro_split_groups", 0) + gb.split_groups
    return gb


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
    buffer.zorro_split_groups = getattr(buffer, "zorro_split_groups", 0) + split


def install_replay_buffer(cls) -> None:
    """Make OpenRLHF's ``NaiveReplayBuffer`` serve group micro-batches to the training ``DataLoader`` (idempotent).

    Without dynamic batching the buffer presents itself as a dataset of micro-batches (``sample_batch_size = 1``,
    one item = one micro-batch of ``micro_train_batch_size`` samples, collated by OpenRLHF's
    ``make_experience_batch``); with dynamic batching OpenRLHF's partitions are regrouped
    (:func:`regroup_dynamic_batch`).
    ``zorro_split_groups`` counts the groups cut.
    """
    if getattr(cls, "_zorro_installed", False):
        return
    init, append, clear = cls.__init__, cls.append, cls.clear
    length, getitem, collate = cls.__len__, cls.__getitem__, cls.collate_fn
    setup_dynamic = cls.setup_dynamic_batch

    def __init__(self, sample_batch_size, *args, **kwargs):
        init(self, sample_batch_size, *args, **kwargs)
        self._zorro_micro_batch_size = sample_batch_size
        self._zorro_batches = None
        self.zorro_split_groups = 0
        if not self.dynamic_batch:
            self.sample_batch_size = 1  # the DataLoader batches micro-batches, one at a time

    def _grouped(self) -> bool:
        return not self.dynamic_batch and "_zorro_micro_batch_size" in self.__dict__

    def new_append(self, experience):
        self._zorro_batches = None
        return append(self, experience)

    def new_clear(self):
        self._zorro_batches = None
        return clear(self)

    def new_len(self):
        return len(_buffer_batches(self)) if _grouped(self) else length(self)

    def new_getitem(self, idx):
        if not _grouped(self):
            return getitem(self, idx)
        return [self.items[i] for i in _buffer_batches(self).batches[idx]]

    def new_collate(self, batch):
        if _grouped(self):
            batch = batch[0]
            from openrlhf.trainer.ppo_utils.experience import make_experience_batch

            return make_experience_batch(batch, self.packing_samples)
        return collate(self, batch)

    def new_setup_dynamic_batch(self, strategy):
        setup_dynamic(self, strategy)
        regroup_dynamic_batch(self, strategy)

    cls.__init__, cls.append, cls.clear = __init__, new_append, new_clear
    cls.setup_dynamic_batch = new_setup_dynamic_batch
    cls.__len__, cls.__getitem__, cls.collate_fn = new_len, new_getitem, new_collate
    cls._zorro_installed = True


# ---------------------------------------------------------------------------------------------- experience maker
def _rollout_n(args) -> int:
    return int(getattr(args.rollout, "n_samples_per_prompt", 1) or 1)


def split_rollout_samples(self, rollout_samples):
    """``RemoteExperienceMaker.split_rollout_samples`` that keeps groups whole (replaces the method).

    Fixed micro-batches (``--rollout.micro_batch_size``) are OpenRLHF's contiguous chunks (the n samples of a prompt
    arrive together): groups stay whole when the size is a multiple of ``n_samples_per_prompt``; otherwise warned
    once and counted (``zorro_split_groups``). With dynamic batching the length-balanced partition is replaced by
    :func:`dynamic_partitions` on the deduplicated cost, rounded up to a multiple of the actor's DP size.
    """
    from openrlhf.trainer.ppo_utils.experience import Experience

    args = self.args
    for i, sample in enumerate(rollout_samples):
        sample.index = [i]
    pad = self.tokenizer.pad_token_id
    n = _rollout_n(args)
    if not args.train.dynamic_batch_enable:
        size = args.rollout.micro_batch_size
        if n > 1 and size % n and not getattr(self, "_zorro_warned_misaligned", False):
            self._zorro_warned_misaligned = True
            logger.warning("zorro: --rollout.micro_batch_size %d is not a multiple of --rollout.n_samples_per_prompt "
                           "%d, so experience-making micro-batches cut prompt groups (each piece recomputes its "
                           "prompt); use a multiple of n.", size, n)
        out = [Experience.concat_experiences(rollout_samples[i: i + size], pad)
               for i in range(0, len(rollout_samples), size)]
        self.zorro_split_groups = getattr(self, "zorro_split_groups", 0) + sum(
            1 for i in range(size, len(rollout_samples), size) if n > 1 and i % n)
        return out
    g, p, r = _items_groups(rollout_samples)
    dp = (args.actor.num_nodes * args.actor.num_gpus_per_node // args.ds.ring_attn_size
          // args.ds.tensor_parallel_size)
    mbs = dynamic_partitions(g, p, r, args.rollout.max_tokens_per_gpu)
    count = -(-max(len(mbs), dp) // dp) * dp  # a multiple of the DP size: each rank gets the same number
    if count > len(mbs):
        mbs = dynamic_partitions(g, p, r, args.rollout.max_tokens_per_gpu, count)
    self.zorro_split_groups = getattr(self, "zorro_split_groups", 0) + mbs.split_groups
    return [Experience.concat_experiences([rollout_samples[i] for i in rows], pad) for rows in mbs.batches]


def balance_experiences(experiences, args):
    """OpenRLHF's ``balance_experiences`` (dynamic batching: one ``Experience`` per DP rank) with whole groups per
    rank: ``balance_groups_across_ranks`` on the deduplicated cost, equal row counts per rank (``B // dp``, the
    first ``B % dp`` one more, as OpenRLHF's interleaving gives)."""
    from openrlhf.trainer.ppo_utils.experience import make_experience_batch, split_experience_batch

    items = [it for e in experiences for it in split_experience_batch(e)]
    dp = (args.actor.num_nodes * args.actor.num_gpus_per_node // args.ds.ring_attn_size
          // args.ds.tensor_parallel_size)
    g, p, r = _items_groups(items)
    bal = balance_groups_across_ranks(g, p, r, dp, equal_size=True)
    if bal.split_groups:
        logger.info("zorro: DP balancing split %d prompt group(s) across ranks", bal.split_groups)
    return [make_experience_batch([items[b] for b in rows]) for rows in bal.ranks if rows]
