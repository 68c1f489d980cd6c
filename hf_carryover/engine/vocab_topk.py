"""The drafter's top-R tokens and their log-probabilities over the whole vocabulary, in two Triton launches.

Why: a tree round ranks the drafter's tokens at every block position (`log_softmax(logits).topk(R)` over 49152
tokens, 15 positions, R = 8 for the shipped tree). On CUDA `torch.topk` over a row that long runs a multi-block radix
select: in an H100 profile of a 31-node tree round (`h100-2026-12-06c`) about 14 launches and ~50 us with the
log-softmax before it and the sort after, 3.5 % of a 1.42 ms round, for 120 numbers. (A topk inside 1024-token
chunks, tried in `h200-2026-12-03e`, ran as one single-block topk over 720 slices and cost more: 60.5 us.)

Here the first launch gives every (row, chunk of `CHUNK` tokens) a program that keeps its chunk in registers and
takes R maxima one after another (each one masked out before the next), and also the chunk's max and sum of
exponentials; the second gives every row a program that takes R maxima of the chunks' candidates and folds the
chunks' sums into the log-sum-exp. So the log-softmax over the vocabulary is never written: a value is
`logit - logsumexp` in float32 (whatever the logits' dtype: the drafter's bf16 logits are read as they come out of
its head, without a float32 copy of all 49152 columns), the number float32 `log_softmax` gives up to its last bit.

Order: tokens are ranked by their logits (exact, before any rounding), ties to the lower token id. `torch.topk` on
the rounded log-probabilities may order tokens whose rounded values tie either way. Which of two equally likely
tokens a tree proposes changes τ, never the output (the target verifies every token).

Off CUDA the same kernels run in Triton's interpreter when TRITON_INTERPRET=1 was set before Triton was imported (the
CPU tests); the engine uses `torch.topk` there (`draft_topk`).
"""

from __future__ import annotations

import torch

from .triton_attention import available, tl, triton  # (available: re-exported)

CHUNK = 1024  # tokens a first-stage program ranks (a power of two; 48 chunks for the reference vocabulary)
MAX_RANK = 64  # the most ranks the engine asks of the kernels (R maxima taken one after another per program)


if triton is not None:
    _NONE = tl.constexpr(2 ** 31 - 1)  # the index a masked lane carries: above every token id, so ties never pick it

    @triton.jit
    def _chunk_kernel(x_ptr, sx, V, C, mx_ptr, se_ptr, val_ptr, idx_ptr, R: tl.constexpr, CHUNK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + row * sx + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
        m = tl.max(x, 0)
        tl.store(mx_ptr + row * C + c, m)
        tl.store(se_ptr + row * C + c, tl.sum(tl.exp(x - m), 0))
        ids = tl.where(offs < V, offs, _NONE)
        base = (row * C + c) * R
        for j in tl.static_range(R):
            v = tl.max(x, 0)
            i = tl.min(tl.where(x == v, ids, _NONE), 0)  # the lowest id holding the max
            tl.store(val_ptr + base + j, v)
            tl.store(idx_ptr + base + j, i)
            x = tl.where(ids == i, -float("inf"), x)
            ids = tl.where(ids == i, _NONE, ids)  # taken: never again, even among -inf ties

    @triton.jit
    def _merge_kernel(mx_ptr, se_ptr, val_ptr, idx_ptr, out_v, out_i, C, V, R: tl.constexpr, CB: tl.constexpr,
                      NB: tl.constexpr):
        row = tl.program_id(0)
        cs = tl.arange(0, CB)
        m = tl.load(mx_ptr + row * C + cs, mask=cs < C, other=-float("inf"))
        s = tl.load(se_ptr + row * C + cs, mask=cs < C, other=0.0)
        top = tl.max(m, 0)
        lse = top + tl.log(tl.sum(s * tl.exp(m - top), 0))  # log sum_v exp(x_v), from each chunk's max and sum
        n = tl.arange(0, NB)
        v = tl.load(val_ptr + row * C * R + n, mask=n < C * R, other=-float("inf"))
        ids = tl.load(idx_ptr + row * C * R + n, mask=n < C * R, other=_NONE)
        for j in tl.static_range(R):
            best = tl.max(v, 0)
            i = tl.min(tl.where(v == best, ids, _NONE), 0)
            tl.store(out_v + row * R + j, best - lse)
            tl.store(out_i + row * R + j, tl.minimum(i, V - 1).to(tl.int64))  # (V - 1: only if < R tokens exist)
            v = tl.where(ids == i, -float("inf"), v)
            ids = tl.where(ids == i, _NONE, ids)


def _launch(logits: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    v = logits.shape[-1]
    x = logits.reshape(-1, v)  # [rows, V] (a copy only where the leading dims are not one stride apart)
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, chunks = x.shape[0], triton.cdiv(v, CHUNK)
    f32 = dict(dtype=torch.float32, device=x.device)
    mx, se = torch.empty(rows, chunks, **f32), torch.empty(rows, chunks, **f32)
    cand_v = torch.empty(rows, chunks, r, **f32)
    cand_i = torch.empty(rows, chunks, r, dtype=torch.int32, device=x.device)
    out_v = torch.empty(rows, r, **f32)
    out_i = torch.empty(rows, r, dtype=torch.long, device=x.device)
    if rows:
        _chunk_kernel[(rows, chunks)](x, x.stride(0), v, chunks, mx, se, cand_v, cand_i, R=r, CHUNK=CHUNK,
                                      num_warps=4)
        _merge_kernel[(rows,)](mx, se, cand_v, cand_i, out_v, out_i, chunks, v, R=r,
                               CB=triton.next_power_of_2(chunks), NB=triton.next_power_of_2(chunks * r), num_warps=4)
    shape = (*logits.shape[:-1], r)
    return out_v.view(shape), out_i.view(shape)


@torch.library.custom_op("hf_carryover::vocab_topk", mutates_args=())
def vocab_topk(logits: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits.float().log_softmax(-1).topk(r, -1)` (float32 values, int64 indices) by the two kernels above:
    an opaque op to torch.compile, capturable in CUDA graphs. r <= the vocabulary size."""
    return _launch(logits, r)


@vocab_topk.register_fake
def _(logits, r):
    shape = (*logits.shape[:-1], r)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.long)


def draft_topk(logits: torch.Tensor, r: int, kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-r log-probabilities (float32) and tokens of `logits` `[..., V]`: `vocab_topk` with `kernel`, else
    torch's log_softmax and topk in float32 (the same tokens but for ties, module docstring)."""
    if kernel:
        return vocab_topk(logits, r)
    return logits.float().log_softmax(-1).topk(r, -1)


__all__ = ["CHUNK", "MAX_RANK", "available", "draft_topk", "vocab_topk"]
