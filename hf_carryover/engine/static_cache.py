"""Position-indexed static KV caches for the fast engine (gpt-fast style: preallocate once, never copy).

Both caches store row r's key/value for absolute position p at index p. Nothing is ever cropped: a rejected
draft's K/V stays where it was written, invisible because attention masks by position (a query at position q
sees keys at positions <= q for the target, < anchor for the drafter), and the next verification overwrites
it. Rollback is therefore free, and every round has the same shapes (what CUDA graphs need).

The same argument lets the engine reuse both caches across `generate()` calls without clearing them: a
query only ever sees positions below its row's anchor (committed: written by this call's prefill or accepted
verifications) and the block it is verifying (written in the same forward, before attention), so whatever an
earlier prompt left at higher positions is masked out until this call overwrites it. (A masked key adds an
exact zero only while its K/V are finite; rejected drafts within one call rely on the same property.)
"""

from __future__ import annotations

import torch

# re-exported: remote code and generate() use them too
from ..modeling_drafter import DrafterStaticCache, put_positions  # noqa: F401


class TargetStaticCache:
    """Duck-typed transformers cache: each attention layer calls `update(k, v, layer_idx)`; we scatter the new rows
    at `self.positions` `[b, n]` and hand back the whole buffer `[b, kv_heads, max_len, head_dim]`. The 4D mask
    passed with it makes the model attend only to written, causal positions.

    The buffer is heads-major, as transformers' caches. A position-major buffer (`[b, max_len, kv_heads, head_dim]`
    handed out as its transposed view, so a new row's heads land in one run) was tried for the 4.3 us key RoPE +
    scatter kernel of a tree round and changed nothing on the H200: 1.775 ms a round either way on HumanEval, with the
    same tokens (`examples/results/h200-2026-12-04`)."""

    is_compileable = False

    def __init__(self, num_layers, batch, kv_heads, max_len, head_dim, dtype, device, key_positions=None):
        self.is_sliding = [False] * num_layers  # read by transformers' mask helpers (5.17: one flag per layer)
        # one tensor per layer: views of one shared buffer would let a tree round move rows with one gather, but every
        # in-place write to a view of a shared base is something a compiled round must track across all layers
        shape = (batch, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.positions: torch.Tensor | None = None
        self.max_len = max_len
        # key positions `arange(max_len)`, made once (no per-round arange); the engine passes its own `_steps`
        self._keys = key_positions if key_positions is not None else torch.arange(max_len, device=device)
        self.rows = torch.arange(batch, device=device)[:, None]  # [b, 1]: the batch index of `put_positions`

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # the new rows [b, kv_heads, n, head_dim] at `positions` [b, n] (in place, see `put_positions`)
        put_positions(self.k[layer_idx], self.rows, self.positions, key_states)
        put_positions(self.v[layer_idx], self.rows, self.positions, value_states)
        return self.k[layer_idx], self.v[layer_idx]

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V rows at slots `src` `[b, n]` to slots `dst` `[b, n]` (read all, then write all)."""
        _, h, _, d = self.k[0].shape
        src = src[:, None, :, None].expand(-1, h, -1, d)  # [b, kv_heads, n, head_dim]
        for buf in self.k + self.v:
            put_positions(buf, self.rows, dst, buf.gather(2, src))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly

    def get_mask_sizes(self, *args, **kwargs):
        return self.max_len, 0

    def __len__(self):
        return len(self.k)

    def causal_mask(self, positions: torch.Tensor) -> torch.Tensor:
        """`[b, 1, n, max_len]` bool: query at position q sees keys at positions <= q."""
        return self._keys[None, None, None, :] <= positions[:, None, :, None]


__all__ = ["TargetStaticCache", "DrafterStaticCache"]
