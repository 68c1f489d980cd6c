"""Gated MLPs whose down projection reads SiLU(gate) * up inside its GEMM, while the engine decodes (`skinny_rows`
with `gated_mlp=True`; off by default, as it lost).

Why: in a compiled tree round every decoder layer launches a pointwise kernel for SiLU(gate) * up between the merged
gate/up GEMM and the down projection: 30 launches of 1.27 us a round for the reference target on an H100
(`h100-2026-12-06c`), each also a gap in the round. `skinny_gemm.silu_mul_mm` computes that product in the down
projection's loads, so the round launches neither the pointwise kernel nor a separate GEMM for it.

How: for the duration of the engine's calls (`SpeculativeEngine.attention_context`), each MLP of the form transformers
writes for Llama, Qwen3, Mistral and the drafter's layers (`gate_proj`, `up_proj`, `down_proj` linears without bias,
SiLU activation, a hidden size of at most `skinny_gemm.MAX_COLS`) gets `gated_forward` as its instance `forward`; on
exit the class's forward is back. The bound methods are made once per engine and set again on every call, so a
compiled round sees the same objects each time and does not recompile. Calls of more than `rows` token rows (a
prefill), or whose row count is not a plain int (a prefill compiled with a dynamic width), run the class's forward.

Timed on an H100 (`h100-2026-12-06d`) it lost: the kernel took 22-25 us where eager SiLU and product kernels and
cuBLAS took 9.8 together (`examples/gemm_bench.py --shapes down down_gated`), and a tree 31 + lookup round of the real
target took 2.004 against 1.418 ms. Fewer, wider programs, which recompute SiLU(gate) * up less often, did not
help (32 columns a program: 21.7 us; 64 and 128: 58-87 us), so that alone does not fix it; where the time goes inside
the kernel was not profiled. It stays as an option for study.
"""

from __future__ import annotations

import types

import torch

from .skinny_gemm import MAX_COLS, MAX_ROWS, settings, silu_mul_mm


def _is_gated_silu_mlp(module) -> bool:
    """A gated SiLU MLP whose down projection is no wider than the kernel is used for (`skinny_gemm.MAX_COLS`)."""
    parts = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    act = getattr(module, "act_fn", None)
    return (all(isinstance(p, torch.nn.Linear) and p.bias is None for p in parts)
            and type(act).__name__ in ("SiLU", "SiLUActivation") and parts[2].out_features <= MAX_COLS)


def gated_forward(self, x):
    """`down_proj(silu(gate_proj(x)) * up_proj(x))` through `silu_mul_mm` for at most `self._gated_rows` rows."""
    rows = x.shape[:-1].numel()
    if not isinstance(rows, int) or rows > self._gated_rows or rows == 0:
        return type(self).forward(self, x)
    gate = self.gate_proj(x).reshape(rows, -1)  # [..., I] -> [rows, I]
    up = self.up_proj(x).reshape(rows, -1)
    out = silu_mul_mm(gate, up, self.down_proj.weight, *settings(rows, gate.shape[1]))  # [rows, hidden]
    return out.reshape(*x.shape[:-1], -1)


class GatedMLPs:
    """A context manager over the gated SiLU MLPs of `models` (None entries skipped): inside it their forward is
    `gated_forward` for calls of at most `rows` rows. `self.modules` lists what it swaps."""

    def __init__(self, models, rows: int):
        self.modules = [m for model in models if model is not None for m in model.modules() if _is_gated_silu_mlp(m)]
        self.rows = min(int(rows), MAX_ROWS)
        self._bound = [types.MethodType(gated_forward, m) for m in self.modules]  # made once: see the module docstring

    def __enter__(self):
        for m, bound in zip(self.modules, self._bound):
            m._gated_rows = self.rows
            m.forward = bound
        return self

    def __exit__(self, *exc):
        for m in self.modules:
            m.__dict__.pop("forward", None)
        return False


__all__ = ["GatedMLPs", "gated_forward"]
