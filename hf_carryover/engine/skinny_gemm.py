"""A Triton GEMM for the few-row projections of the engine's rounds: `x @ w.T` with x `[M, K]`, M up to 64.

Why: a tree round verifies 32 rows, and in the H100 profile of `h100-2026-12-06c` its target forward spent 0.50 of
1.05 ms in 121 cuBLAS GEMMs of 32 rows (3.7-4.2 us each: qkv, o, gate/up, down of 30 layers), while the whole weight
set of a layer (7.1 MB) streams in about 2 us at the card's bandwidth. At these sizes a GEMM is bound by its fixed
latencies (launch, the first loads, a K loop of dependent steps), not by arithmetic or bytes. This kernel gives every
program a narrow slice of output columns (`block_n`) for all rows at once, so each weight element is read once and
the grid is wide (a 576-column projection: 36 programs at 16 columns), and it walks K in large steps (`block_k`) that
Triton pipelines (`num_stages`).

The engine uses it only with `skinny_rows` (opt-in), for the shapes where `examples/gemm_bench.py` timed it faster
than cuBLAS inside CUDA graphs (`settings`, `MAX_COLS`). On the real target the round did not get cheaper with it
(`h100-2026-12-06d`), so it stays off. Gated MLPs' down projections with SiLU(gate) * up made in its loads
(`silu_mul_mm`, `gated_mlp.py`, `gated_mlp=True`) were slower: 22-25 against 9.8 us. It is exact up to the order of the
float32 sums inside one dot product (the fp32 check of compiled tree rounds passed on the GPU).
"""

from __future__ import annotations

import functools

import torch

# Triton (None where it is not installed) and where a Triton kernel can run: the attention kernel's own rules
from .triton_attention import available, tl, triton  # (available: re-exported)


if triton is not None:

    @triton.jit
    def _skinny_kernel(x_ptr, u_ptr, w_ptr, y_ptr, M, N, K, sxm, sxk, su_m, su_k, swn, swk, sym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       STAGES: tl.constexpr, IEEE: tl.constexpr, F64: tl.constexpr, GATED: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x / y
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] rows of w = columns of y
        rk = tl.arange(0, BLOCK_K)
        if F64:  # float64 models (the CPU tests): float64 sums
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float64)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            kk = k0 + rk
            x = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :] * sxk, mask=(rm[:, None] < M) & (kk[None, :] < K),
                        other=0.0)  # [BLOCK_M, BLOCK_K]
            if GATED:  # the input is SiLU(x) * u, made here from the two halves (`silu_mul_mm`)
                u = tl.load(u_ptr + rm[:, None] * su_m + kk[None, :] * su_k,
                            mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
                if F64:
                    xf, uf = x.to(tl.float64), u.to(tl.float64)
                else:
                    xf, uf = x.to(tl.float32), u.to(tl.float32)
                x = (xf * tl.sigmoid(xf) * uf).to(x.dtype)  # rounded to the GEMM's input dtype
            w = tl.load(w_ptr + rn[None, :] * swn + kk[:, None] * swk, mask=(rn[None, :] < N) & (kk[:, None] < K),
                        other=0.0)  # [BLOCK_K, BLOCK_N]: w's rows read as columns
            if IEEE:  # fp32 inputs: IEEE products, not TF32 (so fp32 decoding can be checked exactly)
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
        tl.store(y_ptr + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


def fit_block_k(block_m: int, block_n: int, block_k: int, stages: int, itemsize: int, gated: bool,
                smem: int | None) -> int:
    """`block_k`, halved (down to 32) until `stages` copies of the input tiles (x, up for `silu_mul_mm`, and w's
    `[block_k, block_n]`) fit in `smem` bytes of shared memory (None: no limit, e.g. Triton's interpreter). Why:
    `settings` was timed in bf16 at up to 32 rows; on an H100 (232448 bytes) bf16 at 64 rows asked for exactly this
    estimate, 245760 bytes, and fp32 SiLU * up at 32 rows for 393216, both with block_k 512 (`h100-2026-12-06d`).
    Some shapes that passed there need less than the estimate; the cost of a shorter K step there is untimed."""
    tiles = 2 if gated else 1
    while smem is not None and block_k > 32 and stages * (block_m * tiles + block_n) * block_k * itemsize > smem:
        block_k //= 2
    return block_k


@functools.lru_cache(maxsize=None)
def _smem(device) -> int | None:
    """Shared memory a program may use on `device` (CUDA; 48 KiB where the property is missing), None elsewhere."""
    if device.type != "cuda":
        return None
    return int(getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 49152))


def _launch(x, w, block_n, block_k, num_warps, num_stages, u=None):
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = max(16, triton.next_power_of_2(m))
    gated = u is not None
    block_k = fit_block_k(block_m, block_n, block_k, num_stages, x.element_size(), gated, _smem(x.device))
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    u = x if u is None else u
    _skinny_kernel[grid](x, u, w, y, m, n, k, x.stride(0), x.stride(1), u.stride(0), u.stride(1), w.stride(0),
                         w.stride(1), y.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                         STAGES=num_stages, IEEE=x.dtype == torch.float32, F64=x.dtype == torch.float64, GATED=gated,
                         num_warps=num_warps)
    return y


def _check(x, w, u=None):
    if w.dim() != 2 or x.dim() != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"skinny_mm: x {tuple(x.shape)} and w {tuple(w.shape)} must be [M, K] and [N, K]")
    if u is not None and (u.shape != x.shape or u.dtype != x.dtype):
        raise ValueError(f"silu_mul_mm: gate {tuple(x.shape)} {x.dtype} and up {tuple(u.shape)} {u.dtype} differ")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"skinny_mm takes at most {MAX_ROWS} rows, got {x.shape[0]}")


@torch.library.custom_op("hf_carryover::skinny_mm", mutates_args=())
def skinny_mm(x: torch.Tensor, w: torch.Tensor, block_n: int = 16, block_k: int = 256, num_warps: int = 4,
              num_stages: int = 3) -> torch.Tensor:
    """`x @ w.T` for x `[M, K]` and w `[N, K]` (an nn.Linear weight, any strides): `[M, N]` in x's dtype, float32
    accumulation (float64 for float64). All M rows (at most 64) go to one program per `block_n` columns. An opaque op
    to torch.compile, capturable in CUDA graphs."""
    _check(x, w)
    return _launch(x, w, block_n, block_k, num_warps, num_stages)


@skinny_mm.register_fake
def _(x, w, block_n=16, block_k=256, num_warps=4, num_stages=3):
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.custom_op("hf_carryover::silu_mul_mm", mutates_args=())
def silu_mul_mm(gate: torch.Tensor, up: torch.Tensor, w: torch.Tensor, block_n: int = 16, block_k: int = 256,
                num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """`(silu(gate) * up) @ w.T`, a gated MLP's down projection with its input made inside the GEMM's loads (gate,
    up `[M, K]`, any strides, e.g. the two halves of a merged gate/up GEMM's output; w `[N, K]`). The product is
    computed in float32 (float64 for float64) and rounded to the inputs' dtype before the dot, as a separate kernel
    would store it. Why: it saves the round's 30 SiLU * up launches (`gated_mlp.py`)."""
    _check(gate, w, up)
    return _launch(gate, w, block_n, block_k, num_warps, num_stages, u=up)


@silu_mul_mm.register_fake
def _(gate, up, w, block_n=16, block_k=256, num_warps=4, num_stages=3):
    return gate.new_empty(gate.shape[0], w.shape[0])


def settings(m: int, k: int) -> tuple[int, int, int, int]:
    """(block_n, block_k, num_warps, num_stages) for `m` rows and input width `k`: the fastest of 54 settings at 16
    and 32 rows on an H100 (`examples/gemm_bench.py`, `h100-2026-12-06c`): 16 columns a program, K in steps of 256
    (512 from K = 1536 on), 2 warps up to 16 rows and 4 above, 3 pipeline stages."""
    return 16, 256 if k <= 1024 else 512, 2 if m <= 16 else 4, 3


# the widest output the engine gives the kernel: on the H100 it beat cuBLAS at 576 and 960 columns and lost at 3072
# (gate/up, 32 rows); the vocabulary head stays with cuBLAS too
MAX_COLS = 1024
MAX_ROWS = 64


__all__ = ["MAX_COLS", "MAX_ROWS", "available", "fit_block_k", "settings", "silu_mul_mm", "skinny_mm"]
