"""PyTorch versions of the ops our Mosaic GPU kernels replace, as a PyTorch serving stack would run them: the benches
time them (scripts/timing.py's `cuda_time_us`) beside our kernels on the same data. PyTorch has no FP4 / block-scaled
FP8 GEMM or attention on Hopper, so they take bf16 caches and weights (dequantized once, untimed): 2-3.6x the bytes
our kernels read. Plain torch (no JAX): tests/test_torch_baselines.py checks it in the Python 3.11 reference env.
"""

from __future__ import annotations

import math

import torch


def decode_attention(q: torch.Tensor, win: torch.Tensor, win_valid: torch.Tensor, pool: torch.Tensor,
                     rows: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """`sparse_attention_reference`'s math: one query a sequence over its window and selected entries, the heads
    sharing one latent (K = V), a per-head sink in the denominator. q [B, H, D], win [B, W, D], win_valid [B, W],
    pool [N, D], rows [B, K] (pool rows of the selected entries, -1 = none), sink f32 [H] -> [B, H, D], q's dtype."""
    d = q.shape[-1]
    sel = pool[rows.clamp(min=0).long()]  # [B, K, D]: the gather a paged PyTorch kernel does
    kv = torch.cat([win, sel], 1)
    valid = torch.cat([win_valid, rows >= 0], 1)  # [B, W + K]
    s = torch.einsum("bhd,bnd->bhn", q, kv).float() / math.sqrt(d)
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    m = torch.maximum(s.amax(-1), sink[None, :].float())  # [B, H]
    p = torch.exp(s - m[..., None])
    den = p.sum(-1) + torch.exp(sink[None, :].float() - m)
    o = torch.einsum("bhn,bnd->bhd", p.to(kv.dtype), kv).float() / den[..., None]
    return o.to(q.dtype)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """x [M, K] sorted by group, group g's rows times w[g]^T (w [G, N, K]) -> [M, N] in x's dtype: one
    `torch._grouped_mm` (CUTLASS) where this torch has it on this device, else a loop (the CPU, older torch)."""
    ends = torch.cumsum(group_sizes.to(torch.int32), 0).to(torch.int32)
    if x.is_cuda and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)
    out = torch.zeros(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for g, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = (x[start:end].float() @ w[g].float().T).to(x.dtype)
        start = end
    return out


def route(x: torch.Tensor, w32: torch.Tensor, bias: torch.Tensor, k: int, route_scale: float, gate_temp: float = 1.0):
    """The MoE router as a PyTorch stack runs it (DeepSeek's Gate with float32 logits): x [T, D] bf16, w32 [E, D]
    float32 (the gate weight, converted once), bias float32 [E] -> (weights float32 [T, k], ids [T, k], order
    [T*k] (stable sort of the ids), group sizes [E]) = `pallas_kernels.router.route_reference`'s outputs."""
    scores = torch.sqrt(torch.nn.functional.softplus(torch.nn.functional.linear(x.float(), w32) / gate_temp))
    ids = torch.topk(scores + bias, k, dim=-1).indices
    wts = scores.gather(1, ids)
    wts = wts / (wts.sum(-1, keepdim=True) + 1e-20) * route_scale
    flat = ids.flatten()
    return wts, ids, torch.sort(flat, stable=True).indices, torch.bincount(flat, minlength=w32.shape[0])
