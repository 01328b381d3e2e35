"""OpenRLHF-layout batches for the OpenRLHF tests: samples as OpenRLHF's rollout builds them (one contiguous span
``[prompt | response]``, ``action_mask`` of length ``L - 1`` marking the response tokens), padded right."""

from __future__ import annotations

import torch

#: (prompt id, response length, action pattern or None = all actions): interleaved siblings, a 1-token and an
#: empty response, a multi-turn response whose middle tokens (a tool observation) are not actions.
MIXED_ROWS = [(0, 4, None), (1, 1, None), (0, 6, None), (2, 3, None), (1, 0, None), (0, 2, None), (2, 5, None),
              (1, 6, [1, 1, 0, 0, 1, 1])]
PROMPT_LENS = (5, 3, 4)


def make_samples(rows=MIXED_ROWS, prompt_lens=PROMPT_LENS, vocab: int = 128, seed: int = 0):
    """``[(tokens [L] int64, action [L-1] int64)]``: prompts drawn once per prompt id, responses per row."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (n,), generator=g) for n in prompt_lens]
    out = []
    for pid, r, pattern in rows:
        resp = torch.randint(1, vocab, (r,), generator=g)
        tokens = torch.cat([prompts[pid], resp])
        action = torch.zeros(len(tokens) - 1, dtype=torch.long)
        p = len(prompts[pid])
        action[p - 1: p - 1 + r] = 1 if pattern is None else torch.tensor(pattern)
        out.append((tokens, action))
    return out


def pad_batch(samples):
    """``(sequences [B, T], attention_mask [B, T], action_mask [B, T-1])``, right padded with 0."""
    T = max(len(t) for t, _ in samples)
    B = len(samples)
    seq = torch.zeros(B, T, dtype=torch.long)
    am = torch.zeros(B, T, dtype=torch.long)
    act = torch.zeros(B, T - 1, dtype=torch.long)
    for b, (t, a) in enumerate(samples):
        seq[b, : len(t)] = t
        am[b, : len(t)] = 1
        act[b, : len(a)] = a
    return seq, am, act
