"""The RoPE cos/sin of the target, and of the drafter, as tables read by position while the engine decodes
(`SpeculativeEngine(rope_table="auto")`, the default, or True).

Why: transformers' rotary module computes cos/sin from the positions in every forward, and inductor, compiling a
round as one graph, folds that cheap-looking pointwise work into each layer's RoPE kernels, so every layer recomputes
the same sines and cosines. In the H200's compiled 31-node tree round the key RoPE fused with the cache write was the
costliest pointwise kernel, 4.3 us a layer against 1.4 at one query row (`examples/results/h200-2026-12-03e`,
`inductor_k_rope_scatter.txt`: a cos and a sin per element). With a table, the cos/sin of a position is a load.

A table is the rotary module's own output for positions 0..n-1 (computed once by its own forward, on its device), so
a row reads the values the module would compute for it; only RoPE types whose frequencies do not depend on the
sequence ("dynamic" and "longrope" do) are accepted. The drafter's own rotary module, which runs in its every forward
and cache write, is tabled the same way.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

_SEQUENCE_DEPENDENT = ("dynamic", "longrope")


def rotary_module(model):
    """The one rotary-embedding module of `model` (its `inv_freq` and `attention_scaling`), or the reason there is no
    single one it can table."""
    found = [m for m in model.modules() if hasattr(m, "inv_freq") and hasattr(m, "attention_scaling")]
    if len(found) != 1:
        return f"{len(found)} rotary-embedding modules (one expected)"
    rope_type = getattr(found[0], "rope_type", "default")
    if not isinstance(rope_type, str):  # one per layer type (local and global attention layers)
        return f"rope_type={rope_type!r}: one RoPE per layer type is not supported"
    if rope_type in _SEQUENCE_DEPENDENT:
        return f"rope_type={rope_type!r} changes its frequencies with the sequence length"
    return found[0]


class RopeTable(torch.nn.Module):
    """cos/sin of positions 0..n-1, `[n, head_dim]` fp32 each; called as the rotary module: `(x, position_ids)` ->
    (cos, sin) `[b, q, head_dim]` in x's dtype, as the module returns them. Positions past the table are clamped to its
    last row (rows that finished in a batch may carry them; their tokens are never read)."""

    def __init__(self, rotary, n: int):
        super().__init__()
        positions = torch.arange(n, device=rotary.inv_freq.device)[None]  # [1, n]
        with torch.no_grad():
            cos, sin = rotary(torch.empty(0, device=positions.device), positions)  # fp32 [1, n, head_dim]
        self.register_buffer("cos", cos[0].float(), persistent=False)
        self.register_buffer("sin", sin[0].float(), persistent=False)

    def forward(self, x, position_ids):
        idx = position_ids.clamp(0, self.cos.shape[0] - 1)  # [b, q]
        return self.cos[idx].to(x.dtype), self.sin[idx].to(x.dtype)


def build_rope_tables(models: dict, n: int, untabled: dict | None = None) -> list:
    """[(rotary module, its bound table forward)] for `use_rope_tables`, one per model of `models` ({"target": ...,
    "drafter": ...}; None skipped): the drafter's own rotary module runs in its every forward and cache write too.
    Where a RoPE cannot be tabled: ValueError with the model and the reason, or, given `untabled` (a dict), the
    reason stored under the model's name and that model left to compute its RoPE as usual ("auto"). Each bound
    method is made once: compiled rounds guard on the object a module's `forward` is."""
    ropes = []
    for name, model in models.items():
        if model is None:
            continue
        rotary = rotary_module(model)
        if isinstance(rotary, str):
            if untabled is None:
                raise ValueError(f"rope_table=True: the {name}: {rotary}")
            untabled[name] = rotary
            continue
        if all(rotary is not r for r, _ in ropes):  # a module shared by both is tabled (and put back) once
            ropes.append((rotary, RopeTable(rotary, n).forward))
    return ropes


@contextmanager
def use_rope_tables(ropes):
    """Run the body with each rotary module reading its table (`build_rope_tables`), then put back what they had,
    also after an error. An empty list leaves the modules alone."""
    before = [rotary.__dict__.get("forward") for rotary, _ in ropes]
    for rotary, forward in ropes:
        rotary.forward = forward
    try:
        yield
    finally:
        for (rotary, _), old in zip(ropes, before):
            if old is None:
                del rotary.forward
            else:
                rotary.forward = old


__all__ = ["RopeTable", "build_rope_tables", "rotary_module", "use_rope_tables"]
