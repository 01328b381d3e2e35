"""Response-only log-probs / entropy: the three logits modes vs a direct full-softmax reference (fp64)."""

import pytest
import torch

from zorro_verl.logprob import response_logprobs

TOL = 1e-12


def _setup(n=13, h=6, v=17, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(h, v, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=g, dtype=torch.float64))
        if bias:
            head.bias.copy_(torch.randn(v, generator=g, dtype=torch.float64))
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=g)
    return head, hidden, targets


def _direct(head, hidden, targets, temperature):
    """Independent formulation: p = softmax(z/t); log p[y]; entropy = -sum p log p."""
    z = hidden @ head.weight.T + (head.bias if head.bias is not None else 0)
    logp_all = torch.log_softmax(z / temperature, -1)
    return logp_all[torch.arange(len(targets)), targets], -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("mode", ["none", "compute", "memory"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 4, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_modes_match_direct_reference(mode, temperature, chunk, bias):
    head, hidden, targets = _setup(bias=bias)
    lp_ref, ent_ref = _direct(head, hidden, targets, temperature)
    w1, w2 = torch.randn_like(lp_ref), torch.randn_like(lp_ref)
    params = [hidden, *head.parameters()]
    g_ref = torch.autograd.grad((lp_ref * w1 + ent_ref * w2).sum(), params)

    lp, ent = response_logprobs(hidden, head, targets, temperature=temperature, calculate_entropy=True,
                                logits_optimization=mode, chunk_size=chunk)
    assert lp.dtype == torch.float64 and ent.dtype == torch.float64
    assert (lp - lp_ref).abs().max().item() <= TOL
    assert (ent - ent_ref).abs().max().item() <= TOL
    for p in head.parameters():
        p.grad = None
    (lp * w1 + ent * w2).sum().backward()
    g_got = [hidden.grad, *[p.grad for p in head.parameters()]]
    for a, b in zip(g_ref, g_got):
        assert (a - b).abs().max().item() <= TOL


@pytest.mark.parametrize("mode", ["none", "compute", "memory"])
def test_without_entropy_and_empty(mode):
    head, hidden, targets = _setup()
    lp, ent = response_logprobs(hidden, head, targets, logits_optimization=mode, chunk_size=5)
    assert ent is None
    lp_ref, _ = _direct(head, hidden, targets, 1.0)
    assert (lp - lp_ref).abs().max().item() <= TOL
    lp0, ent0 = response_logprobs(hidden[:0], head, targets[:0], logits_optimization=mode, calculate_entropy=True)
    assert lp0.shape == (0,) and ent0.shape == (0,)


def test_memory_mode_holds_one_chunk_of_logits():
    """The memory mode's forward never materializes more than [chunk, V] logits (it calls lm_head per chunk)."""
    head, hidden, targets = _setup(n=20, v=50)
    seen = []
    head.register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    lp, _ = response_logprobs(hidden, head, targets, logits_optimization="memory", chunk_size=6)
    assert seen and max(s[0] for s in seen) <= 6
    seen.clear()
    lp.sum().backward()  # recompute in backward, again per chunk
    assert seen and max(s[0] for s in seen) <= 6


def test_low_precision_softmax_in_fp32():
    head, hidden, targets = _setup()
    head = head.to(torch.bfloat16)
    lp, ent = response_logprobs(hidden.detach().to(torch.bfloat16), head, targets, calculate_entropy=True)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32


@pytest.mark.parametrize("kwargs,match", [
    (dict(logits_optimization="fast"), "logits_optimization"),
    (dict(temperature=0.0), "temperature"),
    (dict(temperature=-1.0), "temperature"),
    (dict(chunk_size=0), "chunk_size"),
])
def test_bad_arguments(kwargs, match):
    head, hidden, targets = _setup()
    with pytest.raises(ValueError, match=match):
        response_logprobs(hidden, head, targets, **kwargs)
