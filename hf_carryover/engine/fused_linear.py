"""A few-row linear layer with what surrounds it in a decoder layer made in the same Triton kernel:
`y = epilogue(prologue(x) @ w.T)` for x `[M, K]`, M up to 64, w `[N, K]` (or `[2N, K]` with `glu`).

Why: a decoding step of a small target is bound by kernel launches, not bytes. In the H100 profile of
`h100-2026-12-06c` a one-row forward of the reference target was 311 kernels (about 10 a decoder layer, 2.2 us each
on average) and a 32-row verify 312. Around each projection inductor launches kernels of its own: the RMSNorm's
mean (a reduction over the row) before q/k/v, gate/up and the vocabulary head, SiLU(gate) * up between gate/up and
down, and the residual adds. Folded into the projection, a decoder layer needs the merged q/k/v, o, gate/up and down
kernels, attention and RoPE's pointwise kernels, about 7 launches in place of 10.

What each option makes of the same kernel (each a compile-time constant, so each variant is its own kernel):
  * `norm_weight` (RMSNorm before the projection, as transformers writes it for Llama, Qwen, Mistral): every program
    computes its rows' mean of squares itself (float32, as `LlamaRMSNorm` upcasts; the tiled kernel reads x twice for
    it, the one-row kernel once); x is normalised in float32, rounded to x's dtype, scaled by the norm's weight and
    rounded again, the roundings of the eager module. x is the residual stream, a few KB that stay in cache.
    A late norm (x times the norm's weight only, each row's float32 sums scaled by its 1/rms before the
    epilogue, the mean of squares summed in the main loop: no pass over x before the first product) was tried as
    an opt-in and removed: on an H100 it made the real target's round 9.9 % dearer at `fused_linear_rows=32`
    (`h100-2026-12-07b`), and per call it was the slowest form, 1.3-2.3 us dearer than this exact fold at 16-32 rows
    (`h100-2026-12-07c`), besides rounding otherwise than the eager module.
  * `glu`: w holds gate rows `[0, N)` and up rows `[N, 2N)` (a merged gate/up); each program computes both for its
    columns and writes `silu(gate) * up`, each rounded to x's dtype as the eager MLP rounds them.
  * `residual` `[M, N]`: the output is `residual + x @ w.T`, the projection's result rounded before the add (as
    eager: `residual + o_proj(h)`).
One row (a batch-1 plain step) is a sum of products over K per column, every load of a program issued at once (no
tensor-core tile to pad, no loop); from 2 rows on, each program takes all rows with `tl.dot` (a tile of 16 rows and
more, masked). The arithmetic is a GEMM's: products summed in float32 (float64 for float64 models; IEEE, not TF32,
for float32), one rounding at the end, in another order than cuBLAS.

The engine uses it through `fused_linear_rows` (`fold_linears.py` finds the patterns in frozen compiled graphs;
"auto", the default, is 32 rows for CUDA targets of the widths where it was timed; 1 until 2026-12-07, when tree
rounds and batch 8 were timed with 32, `capture.auto_fused_linear_rows`). On an H100 it made
the reference target's batch-1 plain step 20.9 % cheaper (0.725 against 0.916 ms, 80 MT-Bench prompts,
`examples/results/h100-2026-12-06h`); on random weights of its shapes with N=32 (`h100-2026-12-06g`) a plain step
11.6 % cheaper (226 kernels against 318) and a tree 31 + lookup round 3.2 % dearer (1.401 against 1.358 ms: the
tiled kernel took 5.7 us a call where cuBLAS took 3.7-4.2). Its bf16 results equal the eager modules' there or lie
within one bf16 rounding step of them (another summation order). Off CUDA the kernel runs in Triton's interpreter
when TRITON_INTERPRET=1 was set before Triton was imported (the CPU tests); the tests also compile both kernels for
sm_90 with Triton's own ptxas, which needs no GPU but catches what the interpreter, running them as Python, cannot.
"""

from __future__ import annotations

import torch

# Triton (None where it is not installed) and where a Triton kernel can run: the attention kernel's own rules
from .triton_attention import available, tl, triton  # (available: re-exported)

MAX_ROWS = 64
# The engine's pass leaves GEMMs of 2 rows and more with more output columns than this (a vocabulary head) to cuBLAS:
# at 8, 16 and 32 rows on an H100 the tiled kernel lost there even with nothing folded (26.4-26.7 against 23.3-24.1
# us for the reference target's 49152 x 576 head), and with the norm folded at `settings`' old choice for it took 62.9
# us at 32 rows (`h100-2026-12-07`). (One row keeps its head on the one-row kernel, timed faster.)
TILED_MAX_N = 8192


if triton is not None:

    @triton.jit
    def _epilogue(acc, acc_up, r, GLU: tl.constexpr, RESID: tl.constexpr, out_t: tl.constexpr, acc_t: tl.constexpr):
        """Both kernels' end, with the eager modules' roundings: the projection rounded to the output dtype; with
        GLU silu(gate) rounded, times up rounded, rounded (as the eager MLP's kernels store them); with RESID the
        residual plus the rounded projection, rounded (eager adds two stored tensors). `acc_up` is read only with GLU
        and `r` only with RESID; without them the callers pass `acc` (Triton wants every argument bound)."""
        y = acc.to(out_t)
        if GLU:
            g = y.to(acc_t)
            s = (g / (1.0 + tl.exp(-g))).to(out_t)
            y = (s.to(acc_t) * acc_up.to(out_t).to(acc_t)).to(out_t)
        if RESID:
            y = (r.to(acc_t) + y.to(acc_t)).to(out_t)
        return y

    @triton.jit
    def _one_row_kernel(x_ptr, nw_ptr, w_ptr, r_ptr, y_ptr, N, eps, sxk, swn, swk, srn,
                        K: tl.constexpr, KP: tl.constexpr, BLOCK_N: tl.constexpr, NORM: tl.constexpr,
                        GLU: tl.constexpr, RESID: tl.constexpr, F64: tl.constexpr):
        """One row: each program loads its `BLOCK_N` rows of w whole (`[BLOCK_N, KP]`, K padded to a power of two)
        and the row of x whole, so every load is issued at once: one memory latency, no loop."""
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns of y = rows of w
        rk = tl.arange(0, KP)
        col_ok = rn < N
        k_ok = rk < K
        acc_t = tl.float64 if F64 else tl.float32  # what a GEMM accumulates in
        wmask = col_ok[:, None] & k_ok[None, :]
        w = tl.load(w_ptr + rn[:, None] * swn + rk[None, :] * swk, mask=wmask, other=0.0)  # [BLOCK_N, KP]
        if GLU:  # the up projection's rows for the same columns
            wu = tl.load(w_ptr + (rn[:, None] + N) * swn + rk[None, :] * swk, mask=wmask, other=0.0)
        x = tl.load(x_ptr + rk * sxk, mask=k_ok, other=0.0)  # [KP]
        if NORM:  # LlamaRMSNorm: float32 mean of squares, normalised and rounded, times the weight and rounded
            xf = x.to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / K + eps)
            nw = tl.load(nw_ptr + rk, mask=k_ok, other=0.0)
            x = (nw.to(acc_t) * (xf * inv).to(x.dtype).to(acc_t)).to(x.dtype)
        xa = x.to(acc_t)[None, :]
        acc = tl.sum(w.to(acc_t) * xa, 1)  # [BLOCK_N]
        acc_up = acc
        if GLU:
            acc_up = tl.sum(wu.to(acc_t) * xa, 1)
        r = acc
        if RESID:
            r = tl.load(r_ptr + rn * srn, mask=col_ok, other=0.0)
        y = _epilogue(acc, acc_up, r, GLU, RESID, y_ptr.dtype.element_ty, acc_t)
        tl.store(y_ptr + rn, y, mask=col_ok)

    @triton.jit
    def _rows_kernel(x_ptr, nw_ptr, w_ptr, r_ptr, y_ptr, M, N, eps, sxm, sxk, swn, swk, srm, srn, sym,
                     K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     STAGES: tl.constexpr, NORM: tl.constexpr, GLU: tl.constexpr, RESID: tl.constexpr,
                     IEEE: tl.constexpr, F64: tl.constexpr, NORM_K: tl.constexpr):
        """2-64 rows: each program takes all rows (a `BLOCK_M` tile of at least 16, masked) for `BLOCK_N` columns
        with `tl.dot`, K in pipelined steps (`skinny_gemm.py`'s layout); the norm's mean of squares first, its
        loads unrolled so they are issued together, in `NORM_K`-wide chunks (a power of two that divides K where
        there is one, so no chunk is mostly masked) whose squares add up elementwise and are reduced across the
        chunk once at the end. Why: Nsight Compute found the folded kernel issue-bound on this elementwise work,
        which every program repeats (`h100-2026-12-07f`); a cross-thread reduction per 256-wide chunk (as before)
        compiled to 120 shuffles and 216 float adds where one reduction takes 6 and 20, and the third chunk of a
        576-wide x squared mostly masked zeros (PTX counts, `h100-2026-12-07f/cpu/`)."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x / y
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns of y = rows of w
        rk = tl.arange(0, BLOCK_K)
        row_ok = rm < M
        col_ok = rn < N
        acc_t = tl.float64 if F64 else tl.float32
        inv = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if NORM:
            sq = tl.zeros((BLOCK_M, NORM_K), dtype=tl.float32)
            for k0 in tl.static_range(0, K, NORM_K):
                kn = k0 + tl.arange(0, NORM_K)
                xs = tl.load(x_ptr + rm[:, None] * sxm + kn[None, :] * sxk, mask=row_ok[:, None] & (kn[None, :] < K),
                             other=0.0).to(tl.float32)  # [BLOCK_M, NORM_K]
                sq += xs * xs
            inv = 1.0 / tl.sqrt(tl.sum(sq, 1) / K + eps)  # [BLOCK_M]: rsqrt(mean + eps)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_t)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_t)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            kk = k0 + rk
            k_ok = kk < K
            x = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :] * sxk, mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)  # [BLOCK_M, BLOCK_K]
            if NORM:
                nw = tl.load(nw_ptr + kk, mask=k_ok, other=0.0)  # [BLOCK_K]
                x = (x.to(tl.float32) * inv[:, None]).to(x.dtype)
                x = (nw[None, :].to(acc_t) * x.to(acc_t)).to(x.dtype)
            w = tl.load(w_ptr + rn[None, :] * swn + kk[:, None] * swk, mask=col_ok[None, :] & k_ok[:, None],
                        other=0.0)  # [BLOCK_K, BLOCK_N]: w's rows read as columns
            if IEEE:  # float32 inputs: IEEE products, not TF32 (so fp32 decoding can be checked exactly)
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
            if GLU:
                wu = tl.load(w_ptr + (rn[None, :] + N) * swn + kk[:, None] * swk,
                             mask=col_ok[None, :] & k_ok[:, None], other=0.0)
                if IEEE:
                    acc_up = tl.dot(x, wu, acc_up, input_precision="ieee")
                else:
                    acc_up = tl.dot(x, wu, acc_up)
        r = acc
        if RESID:
            r = tl.load(r_ptr + rm[:, None] * srm + rn[None, :] * srn, mask=row_ok[:, None] & col_ok[None, :],
                        other=0.0)
        y = _epilogue(acc, acc_up, r, GLU, RESID, y_ptr.dtype.element_ty, acc_t)
        tl.store(y_ptr + rm[:, None] * sym + rn[None, :], y, mask=row_ok[:, None] & col_ok[None, :])


def settings(m: int, n: int, k: int, glu: bool = False) -> tuple[int, int, int]:
    """(block_n, block_k, num_warps) for `m` rows, `n` output columns, input width `k` and `glu`.

    One row: 4 columns a program (block_k unused: K is loaded whole), 8 warps except for a GLU or a vocabulary head
    (n > 8192), 4 there: the fastest of 4/8/16/32 columns x 2/4/8 warps for each of the reference target's folded
    projections on an H100 (`examples/fused_linear_bench.py`, `h100-2026-12-06g`; a layer's four 10.8 us against
    12.4 with 8 columns). More rows: `skinny_gemm.settings` (16 columns, K in steps of 256, 512 from K = 1536; 2
    warps up to 16 rows, 4 above). At 32 rows these were within 8 % of the best of 16/32/64 columns x K steps of
    128/256 x 4/8 warps for the folded q/k/v, o and gate/up (`h100-2026-12-07`). That sweep tried neither 2 warps nor
    K steps of 512 (so neither 16 rows and fewer nor down), and these took the 32-row head twice the best time (62.9
    against 31.2 us); the engine no longer sends heads wider than `TILED_MAX_N` here."""
    if m == 1:
        return 4, 0, 4 if glu or n > 8192 else 8
    return 16, 256 if k <= 1024 else 512, 2 if m <= 16 else 4


def norm_chunk(k: int, block_k: int) -> int:
    """The tiled kernel's chunk width for the norm's mean of squares: the largest power of two that divides `k`, at
    most `block_k`; `block_k` where that is under 16 (a chunk too narrow to fill a tile; the last one is masked)."""
    chunk = min(k & -k, block_k)
    return chunk if chunk >= 16 else block_k


def _check(x, w, norm_weight, residual, glu):
    if x.dim() != 2 or w.dim() != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"fused_linear: x {tuple(x.shape)} and w {tuple(w.shape)} must be [M, K] and [N, K]")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"fused_linear takes at most {MAX_ROWS} rows, got {x.shape[0]}")
    if glu and w.shape[0] % 2:
        raise ValueError(f"fused_linear(glu=True): w holds gate and up rows, an even count, got {w.shape[0]}")
    if norm_weight is not None and tuple(norm_weight.shape) != (x.shape[1],):
        raise ValueError(f"fused_linear: norm_weight {tuple(norm_weight.shape)} must be [{x.shape[1]}]")
    n = w.shape[0] // 2 if glu else w.shape[0]
    if residual is not None and tuple(residual.shape) != (x.shape[0], n):
        raise ValueError(f"fused_linear: residual {tuple(residual.shape)} must be the output's [{x.shape[0]}, {n}]")


@torch.library.custom_op("hf_carryover::fused_linear", mutates_args=())
def fused_linear(x: torch.Tensor, w: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                 residual: torch.Tensor | None = None, glu: bool = False, block_n: int = 16, block_k: int = 256,
                 num_warps: int = 4) -> torch.Tensor:
    """`epilogue(rmsnorm?(x) @ w.T)` (module docstring): x `[M, K]`, w `[N, K]` (an nn.Linear weight, any strides;
    `[2N, K]`, gate then up, with `glu`), `norm_weight` `[K]` or None, `residual` `[M, N]` or None -> `[M, N]` in x's
    dtype. An opaque op to torch.compile, capturable in CUDA graphs."""
    _check(x, w, norm_weight, residual, glu)
    m, k = x.shape
    n = w.shape[0] // 2 if glu else w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    r = residual if residual is not None else y
    nw = norm_weight if norm_weight is not None else x
    flags = dict(NORM=norm_weight is not None, GLU=bool(glu), RESID=residual is not None,
                 F64=x.dtype == torch.float64, num_warps=num_warps)
    if m == 1:
        _one_row_kernel[(triton.cdiv(n, block_n),)](x, nw, w, r, y, n, float(eps), x.stride(1), w.stride(0),
                                                    w.stride(1), r.stride(1), K=k, KP=triton.next_power_of_2(k),
                                                    BLOCK_N=block_n, **flags)
        return y
    block_m = max(16, triton.next_power_of_2(m))
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _rows_kernel[grid](x, nw, w, r, y, m, n, float(eps), x.stride(0), x.stride(1), w.stride(0), w.stride(1),
                       r.stride(0), r.stride(1), y.stride(0), K=k, BLOCK_M=block_m, BLOCK_N=block_n,
                       BLOCK_K=block_k, STAGES=3, IEEE=x.dtype == torch.float32, NORM_K=norm_chunk(k, block_k),
                       **flags)
    return y


@fused_linear.register_fake
def _(x, w, norm_weight=None, eps=1e-6, residual=None, glu=False, block_n=16, block_k=256, num_warps=4):
    return x.new_empty(x.shape[0], w.shape[0] // 2 if glu else w.shape[0])


def reference(x, w, norm_weight=None, eps=1e-6, residual=None, glu=False):
    """The eager modules' computation of `fused_linear` (what the tests compare it with): LlamaRMSNorm, a linear
    layer, SiLU(gate) * up or a residual add, with their roundings."""
    if norm_weight is not None:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        x = norm_weight * h.to(x.dtype)
    y = x @ w.T
    if glu:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    if residual is not None:
        y = residual + y
    return y


__all__ = ["MAX_ROWS", "TILED_MAX_N", "available", "fused_linear", "norm_chunk", "reference", "settings"]
