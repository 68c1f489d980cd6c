"""Sampling helpers of the engine's rounds: draws from given uniforms, in a fixed order of float additions.

A captured or compiled round holds no random op and no Generator: its uniforms come from the decode state, filled from
the call's generator before each round (`state.DecodeState.draw`), and these functions turn them into tokens.
"""

from __future__ import annotations

import torch


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row from unnormalised `probs` `[b, V]` with uniforms `u` `[b]` in [0, 1): the first index whose
    cumulative mass exceeds u·total. It is a categorical draw like `torch.multinomial`, but from given uniforms,
    so a compiled or captured round needs no Generator. The threshold stays below the total (the float product
    can round up to it), so a zero-probability token is never chosen: its cumulative sum equals the previous one.
    Precision: a token's chance is its interval in the float32 running sum (`running_mass`), off by at most two
    roundings of that sum (about 1e-7 of the total), whatever the vocabulary size."""
    cdf = running_mass(probs)  # [b, V]
    total = cdf[:, -1:]
    x = torch.minimum(u[:, None].float() * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True)[:, 0]


@torch.compiler.disable
def running_mass(probs: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """Inclusive running sum of `probs` `[b, V]` along V in float32, adding in the same order on every launch.

    Why not `probs.cumsum(-1)`: on CUDA a tensor with one row is scanned by CUB's decoupled look-back scan, whose
    grouping of float additions depends on block timing, so the sums change in their last bits from launch to
    launch (pytorch/pytorch#75240). Every boundary of 49152 tokens then moves a little, and a draw that lands in a
    moved sliver picks the neighbouring token: on the H200 two eager runs of the same seeded sampled call parted
    after 19-68 rounds (`trainer/gpu_replay_diff.py`). Here the sum is two scans of many short rows, which ATen runs
    with its per-row kernels (a fixed order): the running sum inside chunks of `chunk` tokens, then the running sum
    of the chunk totals (scanned as a `[b, n, 2]` tensor along dim 1, so it is not a one-row scan either).
    A compiled round leaves this function to those ATen kernels (a graph break; a captured graph replays them like
    any other): inductor's own one-row scan is a look-back scan too (pytorch/pytorch#190946), and on the H200 (torch
    2.11) inductor failed to lower this function ("NotImplementedError: View"), so compiled sampled rounds fell back
    to eager decoding."""
    b, V = probs.shape
    n = -(-V // chunk)
    p = torch.nn.functional.pad(probs.float(), (0, n * chunk - V))  # [b, n*chunk]: zero mass past V
    within = p.view(b, n, chunk).cumsum(-1)  # [b, n, chunk]: running sum inside each chunk
    totals = within[..., -1]  # [b, n]
    ends = torch.stack([totals, torch.zeros_like(totals)], -1).cumsum(1)[..., 0]  # [b, n]: sum through chunk j
    starts = torch.cat([torch.zeros_like(ends[:, :1]), ends[:, :-1]], 1)  # [b, n]: sum before chunk j
    return (within + starts[..., None]).view(b, n * chunk)[:, :V].contiguous()


def point_mass(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """The proposal distribution of looked-up tokens `[b, k]`: all mass on the token, `[b, k, vocab]` float32. A
    scatter rather than `one_hot`, whose value checks would sync on some devices."""
    return torch.zeros(*tokens.shape, vocab, device=tokens.device).scatter_(-1, tokens[..., None], 1.0)


__all__ = ["inverse_cdf", "point_mass", "running_mass"]
