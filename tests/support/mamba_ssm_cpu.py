"""A CPU stand-in for mamba-ssm's fused Mamba-2 scan, ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined``
(Triton; CUDA only), with its signature and semantics, so that zorro's fused-scan path runs on the CPU.

What it reproduces of the kernel: inputs ``x [b, L, H, P]``, ``dt [b, L, H]``, ``A [H]``, ``B / C [b, L, G, N]``,
``chunk_size``; ``dt_bias`` / ``dt_softplus`` / ``dt_limit`` applied to ``dt`` in fp32; ``D`` (``[H]`` or ``[H, P]``);
``initial_states [b, H, P, N]``; ``return_final_states``; the output in ``x``'s dtype, the final states in fp32; the
compute in fp32 (kept in fp64 when ``x`` is fp64, so the fp64 tests stay exact); differentiable in every tensor input
including ``initial_states`` (the kernel's backward returns their gradient). ``z``, ``seq_idx``, ``cu_seqlens`` and the
varlen states are refused (zorro does not pass them).

It is written in the SSD *quadratic* form (the whole sequence as one masked decay matrix), independent of zorro's
chunked :func:`~zorro_verl.recurrent.chunk_ssd`, and checked against the step-by-step definition
(tests/recurrent/test_ssd.py). ``CALLS`` logs each call's dtypes and whether it got initial states.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["mamba_chunk_scan_combined", "CALLS"]

#: One dict per call: ``x`` / ``dt`` / ``B`` dtypes, ``batch``, ``initial_states`` (bool), ``final`` (bool).
CALLS: list[dict] = []


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False):
    if z is not None or seq_idx is not None or cu_seqlens is not None or return_varlen_states:
        raise NotImplementedError("the CPU stand-in of mamba_chunk_scan_combined takes no z / seq_idx / cu_seqlens")
    b, L, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    assert dt.shape == (b, L, H) and A.shape == (H,) and B.shape == C.shape == (b, L, G, N) and H % G == 0
    assert isinstance(chunk_size, int) and chunk_size > 0
    CALLS.append(dict(x=x.dtype, dt=dt.dtype, B=B.dtype, batch=b, initial_states=initial_states is not None,
                      final=bool(return_final_states)))
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf, Bf, Cf, Af = x.to(cdt), B.to(cdt), C.to(cdt), A.to(cdt)
    dtf = dt.to(cdt)
    if dt_bias is not None:
        dtf = dtf + dt_bias.to(cdt)
    if dt_softplus:
        dtf = F.softplus(dtf)
    if tuple(dt_limit) != (0.0, float("inf")):
        dtf = dtf.clamp(dt_limit[0], dt_limit[1])
    Bh = Bf.repeat_interleave(H // G, dim=2)  # [b, L, H, N]
    Ch = Cf.repeat_interleave(H // G, dim=2)
    a = (dtf * Af).transpose(1, 2)  # [b, H, L] log decay per token
    cum = a.cumsum(-1)  # inclusive prefix
    # decay from token j to token i (j <= i): exp(sum_{j < k <= i} a_k) = exp(cum_i - cum_j); masked above the diagonal
    ar = torch.arange(L, device=x.device)
    lower = ar[:, None] >= ar[None, :]
    diff = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf"))
    decay = diff.exp()  # [b, H, L, L]
    scores = torch.einsum("bihn,bjhn->bhij", Ch, Bh) * decay * dtf.transpose(1, 2)[:, :, None, :]
    y = torch.einsum("bhij,bjhp->bihp", scores, xf)  # [b, L, H, P]
    if initial_states is not None:
        s0 = initial_states.to(cdt)  # [b, H, P, N]
        y = y + torch.einsum("bihn,bhpn->bihp", Ch, s0) * cum.exp().transpose(1, 2)[..., None]
    if D is not None:
        y = y + xf * (D.to(cdt)[:, None] if D.dim() == 1 else D.to(cdt))
    out = y.to(x.dtype)
    if not return_final_states:
        return out
    to_end = (cum[..., -1:] - cum).exp() if L else cum  # [b, H, L]: decay from each token to the last
    final = torch.einsum("bhj,bjhp,bjhn->bhpn", to_end * dtf.transpose(1, 2), xf, Bh)
    if initial_states is not None:
        final = final + initial_states.to(cdt) * cum[..., -1].exp()[..., None, None]
    return out, final
