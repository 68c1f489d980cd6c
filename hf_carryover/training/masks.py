"""Attention masks of parallel-anchor training, written once as predicates and materialised two ways.

Key layout of the drafter during training (per sequence):

    [ context: L target rows | carryover: N*k rows (stage 2 only) | blocks: N*B rows ]

Query rows are the N blocks. Block n (anchor position t_n) may see
  * context row j          iff j < t_n and j is a real (non-padding) token — exactly the committed context
                            the drafter has at inference when the anchor sits at t_n;
  * carryover row (m, i)   iff m == n and that row is valid (rejected in block n's verification);
  * block row (m, i)       iff m == n (bidirectional inside the block).

`dense_drafter_mask` evaluates the predicate on a full grid (CPU tests, or GPU when it fits);
`flex_drafter_mask` hands the same predicate to FlexAttention as a `mask_mod` (GPU). A test checks both agree
with an independent loop-based construction. `verify_mask` is the target-side mask of the one-forward
verification of all anchors' proposals (DESIGN.md §5).
"""

from __future__ import annotations

import torch


def _drafter_predicate(anchors, ctx_valid, carry_valid, L: int, k: int, B: int, carry_offset: int):
    """Returns mask_mod(b, h, q, kv) -> bool for the key layout above. anchors `[b, N]`, ctx_valid `[b, L]`,
    carry_valid `[b, G*k]` or None (k == 0); carryover group g belongs to block g + carry_offset."""
    n_carry = 0 if carry_valid is None else carry_valid.shape[1]

    def mask_mod(b, h, q, kv):
        n_q = q // B
        is_ctx = kv < L
        ctx_ok = is_ctx & (kv < anchors[b, n_q]) & ctx_valid[b, kv.clamp(max=L - 1)]
        in_carry = (kv >= L) & (kv < L + n_carry)
        if k > 0:
            c = (kv - L).clamp(min=0, max=n_carry - 1)
            carry_ok = in_carry & (c // k + carry_offset == n_q) & carry_valid[b, c]
        else:
            carry_ok = torch.zeros_like(in_carry)
        blk = kv - L - n_carry
        blk_ok = (blk >= 0) & (blk // B == n_q)
        return ctx_ok | carry_ok | blk_ok

    return mask_mod


def dense_drafter_mask(anchors, ctx_valid, B: int, carry_valid=None, k: int = 0, carry_offset: int = 0):
    """Boolean `[b, 1, N*B, L + G*k + N*B]` mask (True = attend); G carryover groups of k rows."""
    b, N = anchors.shape
    L = ctx_valid.shape[1]
    dev = anchors.device
    n_carry = 0 if carry_valid is None else carry_valid.shape[1]
    mod = _drafter_predicate(anchors, ctx_valid, carry_valid, L, k, B, carry_offset)
    q = torch.arange(N * B, device=dev)
    kv = torch.arange(L + n_carry + N * B, device=dev)
    bi = torch.arange(b, device=dev)[:, None, None]
    return mod(bi, None, q[None, :, None], kv[None, None, :])[:, None]


def flex_drafter_mask(anchors, ctx_valid, B: int, carry_valid=None, k: int = 0, carry_offset: int = 0):
    """The same mask as a FlexAttention BlockMask (GPU path; never materialises the dense grid)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, N = anchors.shape
    L = ctx_valid.shape[1]
    n_carry = 0 if carry_valid is None else carry_valid.shape[1]
    mod = _drafter_predicate(anchors, ctx_valid, carry_valid, L, k, B, carry_offset)
    return create_block_mask(mod, b, None, N * B, L + n_carry + N * B, device=anchors.device)


def verify_mask(anchors, ctx_valid, k: int):
    """Target mask for verifying all anchors in one forward over `[recorded L | N blocks of k+1]`.

    Recorded rows are causal among themselves (and ignore padding); block n's rows see recorded rows < t_n
    and causally their own block — exactly the keys the target sees when it verifies `[x_t, d_1..d_k]` at
    inference. Returns bool `[b, 1, L + N(k+1), L + N(k+1)]`.
    """
    b, N = anchors.shape
    L = ctx_valid.shape[1]
    R = k + 1
    dev = anchors.device
    T = L + N * R
    q = torch.arange(T, device=dev)[:, None]
    kv = torch.arange(T, device=dev)[None, :]
    rec_q, rec_kv = q < L, kv < L
    causal_rec = rec_q & rec_kv & (kv <= q)
    n_q, n_kv = (q - L).clamp(min=0) // R, (kv - L).clamp(min=0) // R
    blk_self = (~rec_q) & (~rec_kv) & (n_q == n_kv) & (kv <= q)
    mask = (causal_rec | blk_self)[None].expand(b, T, T).clone()
    # block rows -> recorded prefix before their anchor
    t_of_q = anchors[:, n_q[:, 0].clamp(max=N - 1)]  # [b, T]
    prefix = (~rec_q[None]) & rec_kv[None] & (kv[None] < t_of_q[:, :, None])
    mask |= prefix
    mask &= torch.cat([ctx_valid, torch.ones(b, N * R, dtype=torch.bool, device=dev)], 1)[:, None, :]
    # keep every row attending to at least itself (padding rows would otherwise produce NaNs)
    mask |= torch.eye(T, dtype=torch.bool, device=dev)[None]
    return mask[:, None]


__all__ = ["dense_drafter_mask", "flex_drafter_mask", "verify_mask"]
