"""GRPO-shaped dummy batches in verl's layout (test and demo input)."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["create_dummy_batch", "batch_from_rows", "shared_system_rows", "multi_turn_rows", "sft_conversations"]


def create_dummy_batch(
    batch_size: int = 8,
    num_unique_prompts: int = 2,
    prompt_len: int = 4096,
    response_len: int = 512,
    device: str = "cuda",
    include_training_fields: bool = False,
    add_padding: bool = False,
    vocab_size: int = 1000,
    seed: int = 0,
    shuffle: bool = False,
) -> dict[str, torch.Tensor]:
    """A GRPO-shaped micro-batch in verl's layout.

    ``num_unique_prompts`` prompts, each repeated ``batch_size / num_unique_prompts`` times (the remainder goes to
    the first prompts). With ``add_padding`` prompts have different valid lengths (left pad) and responses end
    early (right pad); one response in every group of >= 3 has length 1 and the last row of the batch may
    have an empty response. With ``shuffle`` siblings are not adjacent.

    Returns a dict:
        ``input_ids [B, P+R] int64``, ``attention_mask [B, P+R] int64``, ``position_ids [B, P+R] int64``,
        ``responses [B, R] int64``, ``response_mask [B, R] int64``; with ``include_training_fields`` also
        ``old_log_probs``, ``advantages``, ``ref_log_prob`` ``[B, R] float32`` (zeros on pads).
    """
    for name, v in (("batch_size", batch_size), ("num_unique_prompts", num_unique_prompts),
                    ("prompt_len", prompt_len), ("response_len", response_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "response_len" else 1):
            raise ValueError(f"{name}: expected a positive int, got {v!r}.")
    if num_unique_prompts > batch_size:
        raise ValueError(f"num_unique_prompts: expected <= batch_size ({batch_size}), got {num_unique_prompts}.")
    gen = torch.Generator().manual_seed(seed)
    B, G, P, R = batch_size, num_unique_prompts, prompt_len, response_len
    group = torch.arange(B) * G // B  # contiguous groups of near-equal size
    prompts = torch.randint(1, vocab_size, (G, P), generator=gen)
    p_len = torch.full((G,), P)
    r_len = torch.full((B,), R)
    if add_padding:
        p_len = torch.randint(max(1, P // 2), P + 1, (G,), generator=gen)
        p_len[0] = P
        r_len = torch.randint(max(1, R // 2), R + 1, (B,), generator=gen) if R > 0 else r_len
        if R > 0:
            r_len[0] = R
            for g in range(G):
                rows = (group == g).nonzero().flatten()
                if rows.numel() >= 3:
                    r_len[rows[1]] = 1
            if B >= 3 and (group == group[-1]).sum() >= 2:
                r_len[-1] = 0
    input_ids = torch.zeros(B, P + R, dtype=torch.long)
    attention_mask = torch.zeros(B, P + R, dtype=torch.long)
    responses = torch.randint(1, vocab_size, (B, R), generator=gen)
    for b in range(B):
        g = int(group[b])
        p, r = int(p_len[g]), int(r_len[b])
        input_ids[b, P - p:P] = prompts[g, P - p:]
        attention_mask[b, P - p:P + r] = 1
    responses = responses * attention_mask[:, P:]
    input_ids[:, P:] = responses
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0) * attention_mask
    # verl keeps counting positions on the right pad; the valid tokens are what matter.
    response_mask = attention_mask[:, P:].clone()
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "responses": responses,
        "response_mask": response_mask,
    }
    if include_training_fields:
        m = response_mask.float()
        batch["old_log_probs"] = (-torch.rand(B, R, generator=gen) * 2 - 0.1) * m
        adv = torch.randn(G, generator=gen)[group]
        batch["advantages"] = (adv[:, None] + 0.1 * torch.randn(B, R, generator=gen)) * m
        batch["ref_log_prob"] = (-torch.rand(B, R, generator=gen) * 2 - 0.1) * m
    if shuffle:
        perm = torch.randperm(B, generator=gen)
        batch = {k: v[perm] for k, v in batch.items()}
    return {k: v.to(device) for k, v in batch.items()}


def batch_from_rows(rows: list, *, response_masks: Optional[list] = None, include_training_fields: bool = False,
                    seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    """A batch in verl's layout from explicit rows ``[(prompt_tokens, response_tokens), ...]`` (lists of ints).

    ``response_masks``: per row a 0/1 list as long as its response (0 = context not trained, e.g. tool output);
    default all ones. Prompts are left padded to the longest prompt, responses right padded to the longest response
    (at least 1 column). Returns the fields of :func:`create_dummy_batch`."""
    B = len(rows)
    if B == 0:
        raise ValueError("rows: expected at least one (prompt, response) pair, got none.")
    Pw = max(len(p) for p, _ in rows)
    R = max(1, max(len(r) for _, r in rows))
    if min(len(p) for p, _ in rows) < 1:
        raise ValueError("rows: every prompt needs at least one token.")
    input_ids = torch.zeros(B, Pw + R, dtype=torch.long)
    attention_mask = torch.zeros(B, Pw + R, dtype=torch.long)
    response_mask = torch.zeros(B, R, dtype=torch.long)
    for b, (p, r) in enumerate(rows):
        input_ids[b, Pw - len(p):Pw] = torch.tensor(p, dtype=torch.long)
        attention_mask[b, Pw - len(p):Pw + len(r)] = 1
        if r:
            input_ids[b, Pw:Pw + len(r)] = torch.tensor(r, dtype=torch.long)
            m = response_masks[b] if response_masks is not None else [1] * len(r)
            if len(m) != len(r):
                raise ValueError(f"response_masks[{b}]: expected {len(r)} entries (its response), got {len(m)}.")
            response_mask[b, :len(r)] = torch.tensor(m, dtype=torch.long)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0) * attention_mask
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
             "responses": input_ids[:, Pw:].clone(), "response_mask": response_mask}
    if include_training_fields:
        gen = torch.Generator().manual_seed(seed)
        m = attention_mask[:, Pw:].float()
        batch["old_log_probs"] = (-torch.rand(B, R, generator=gen) * 2 - 0.1) * m
        batch["advantages"] = torch.randn(B, R, generator=gen) * m
        batch["ref_log_prob"] = (-torch.rand(B, R, generator=gen) * 2 - 0.1) * m
    return {k: v.to(device) for k, v in batch.items()}


def shared_system_rows(num_questions: int, samples: int, system_len: int, question_len: int, response_len: int,
                       *, vocab_size: int = 1000, seed: int = 0) -> list:
    """Agentic RL shape: ``num_questions x samples`` rows ``(system prompt + question_q, response)``, one system
    prompt (tool specifications) shared by every question. Rows as :func:`batch_from_rows` takes them."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda n: torch.randint(1, vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    system = rnd(system_len)
    rows = []
    for _ in range(num_questions):
        prompt = system + rnd(question_len)
        rows += [(prompt, rnd(response_len)) for _ in range(samples)]
    return rows


def multi_turn_rows(turns: int, first_prompt_len: int, turn_len: int, observation_len: int, *,
                    trajectories: int = 1, vocab_size: int = 1000, seed: int = 0):
    """verl's multi-output agent loop: each trajectory of ``turns`` turns emitted as ``turns`` samples, output
    ``i > 0`` carrying the accumulated conversation (earlier turns and tool observations) as its prompt and the
    ``i``-th assistant turn as its response. Returns ``(rows, response_masks)``; a response ends with the next
    tool observation (``observation_len`` tokens, masked out of the loss) except the last turn's."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda n: torch.randint(1, vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    rows, masks = [], []
    for _ in range(trajectories):
        context = rnd(first_prompt_len)
        for i in range(turns):
            answer = rnd(turn_len)
            obs = rnd(observation_len) if i + 1 < turns else []
            rows.append((list(context), answer + obs))
            masks.append([1] * len(answer) + [0] * len(obs))
            context = context + answer + obs
    return rows, masks


def sft_conversations(conversations: int, turns: int, *, system_len: int, user_len: int, assistant_len: int,
                      vocab_size: int = 1000, seed: int = 0) -> list:
    """Multi-turn SFT samples as verl's multi-turn SFT dataset yields them (``pad_mode: no_padding``): per sample
    ``{"input_ids": [L] int64, "loss_mask": [L] int64, "position_ids": [L] int64}``, the loss mask 1 on assistant
    tokens only. ``conversations`` conversations of ``turns`` (user, assistant) turns behind one shared system prompt;
    each conversation is emitted as ``turns`` samples, sample ``i`` ending after assistant turn ``i`` (the earlier
    turns repeated, with their own assistant tokens in the loss: the usual way multi-turn chats are cut into SFT
    samples). Lengths vary by +-1 token per turn. Feed a list of them to verl's ``SFTTensorCollator``."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda n: torch.randint(1, vocab_size, (max(1, n + int(torch.randint(-1, 2, (1,), generator=gen))),),  # noqa: E731
                                  generator=gen)
    system = rnd(system_len)
    samples = []
    for _ in range(conversations):
        ids, mask = [system], [torch.zeros_like(system)]
        for _ in range(turns):
            user, answer = rnd(user_len), rnd(assistant_len)
            ids += [user, answer]
            mask += [torch.zeros_like(user), torch.ones_like(answer)]
            row = torch.cat(ids)
            samples.append({"input_ids": row, "loss_mask": torch.cat(mask),
                            "position_ids": torch.arange(row.numel())})
    return samples
