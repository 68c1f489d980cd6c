"""A Triton attention kernel for the engine's rounds: grouped K/V heads, the round's boolean mask, and only the keys
some query row can see.

Why: every engine round hands the target a boolean mask over its whole static cache (`max_len` slots, ~640 in the
benchmark), and SDPA (cuDNN's kernel on the H200) reads all of them: 6.5 us a layer for one query row and 14.1 us for
47 (`trainer/gpu_attention_bench.py`, `h200-2026-12-02f`), 0.21 ms of a 1.03 ms plain step. Most slots lie past the
committed context; reading only the first 256 keys had saved 6.4 us a layer at 47 rows. A graph per window length
would multiply the engine's captured rounds, so this kernel finds the used keys itself: the mask says which keys
a row sees, and no row sees a slot past the round's last written position.

What it computes: softmax(q k^T * scale, masked) v for every query head with its group's K/V head (transformers'
`repeat_kv` convention: query head i reads K/V head i // groups), as `F.scaled_dot_product_attention(...,
attn_mask=mask, enable_gqa=True)` does. One program takes one K/V head of one batch row and a block of its
(query row, head-of-the-group) pairs, so each key block is read once for all the heads that share it. It keeps
flash attention's running max and sum (fp32) over key blocks of `BLOCK_N`:

  * `scan` (the default): a first pass over the mask finds the last key any of the program's rows sees; the second
    pass walks the key blocks up to it. The mask pass has no branches, so its loads overlap.
  * `skip`: no first pass; the walk covers the whole cache.
  In both, a key block whose mask is empty for all the program's rows is skipped (its K/V never read).
  * `dense`: `scan`'s first pass, then every key block up to the end is folded in without that branch, so a block's
    K/V loads go out together with its mask's instead of after it, in a `for` loop Triton can pipeline
    (`num_stages`). Why: the kernel is latency-bound at these sizes (a few hundred keys, 3 K/V heads), and up to the
    scan's end nearly every block holds a seen key.

Split over keys (`split_n`, flash-decoding's idea): one program walks its keys one block after another, about 2.8 us per
128 keys at one query row on the H200, so with 1800 keys in use of 2048 a layer took 40.8-42.5 us against SDPA's 6.8-6.9
(`h200-2026-12-03c`; 12.0 us with 256-key parts, 20.3 instead of 47.6 us at 47 rows, SDPA 34.2). With `split_n` the grid
gets a third axis: part s walks keys [s * split_n, (s+1) * split_n) only. Every part first finds (scan) how many parts
hold a seen key; parts past them exit at once, and where one part holds them all it writes the output itself, as without
splitting, so short contexts pay only the scan of the extra programs. Otherwise each part stores its running max, sum
and unnormalised output (fp32) to a workspace and bumps an arrival counter; the part that arrives last folds all of them
together, writes the output and sets the counter back to zero. So the split costs no second kernel and no memset between
layers, which at this model's size would cost about as much as the attention itself. The counters live for the process
(`_counters`, allocated before any capture), one set per device and lane: two split launches running at once (two
streams) must not share them, so the engine decodes on one stream and runs the row prefill's forward, which may run on
a side stream beside the rounds, in a lane of its own (`counter_lane`).

On the H200 (bf16, 200 committed keys of 640) `scan` with 128-key blocks and 4 warps was the fastest setting tried:
5.7 / 8.3 us a layer at 1 / 47 query rows against SDPA's 6.6 / 14.0 (`h200-2026-12-03b`; `skip` 9.9 / 10.9).
Later, with 256-key parts and 150 / 400 keys in use (`h200-2026-12-04d`, 14 settings): at 47 rows `dense` with 16
(query row, head) pairs a program (`block_m=16`) took 4.97 / 7.29 us against 8.55 / 12.19 for `scan` with all 141
pairs of a K/V head in programs of 64 (SDPA 14.2): more, smaller programs and loads that wait on no branch. At one row
`dense` took 4.88 / 6.97 (SDPA 6.60 / 6.56).

`key_end` (`[b]`): the caller hands the end of each batch row's keys in use and the kernel skips its scan. Timed alone
on an H100 (`h100-2026-12-06e`, 30 layers replayed): 0.34-0.81 us (3-9 %) cheaper a layer at 1 and 32 query rows,
batch 1 and 8; in a real tree round the difference did not show (1.410 against 1.405 ms, two machine starts), so the
engine passes it only with `attention_key_end=True`.

A row that sees no key gets zeros (SDPA gives NaN there); the engine never reads such a row. In float32 the
products are exact IEEE products (no TF32), so fp32 greedy decoding can be checked against plain decoding; they are
slow there (887 us a layer at 47 rows), so the engine's "auto" leaves fp32 targets on SDPA. A masked key adds an
exact zero only while its K/V are finite, as in SDPA (`static_cache.py`).

Off CUDA the same kernel runs in Triton's interpreter when TRITON_INTERPRET=1 was set before Triton was imported:
that is how the CPU tests check it (slow, tests only; `tests/test_triton_attention.py` runs it in a subprocess).
"""

from __future__ import annotations

import contextlib
import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine then keeps SDPA (`available()` says why)
    triton = tl = None

MODES = ("scan", "skip", "dense")


def available(device: torch.device | str = "cuda") -> str | None:
    """None when the kernel can run on `device`; otherwise why not."""
    if triton is None:
        return "Triton is not installed (pip install triton)"
    if torch.device(device).type != "cuda" and not os.environ.get("TRITON_INTERPRET"):
        return "off CUDA the kernel runs only in Triton's interpreter (TRITON_INTERPRET=1 before Triton's import)"
    return None


def _fold(q, k_base, v_base, m_row, cols, row_ok, n_keys, skn, svn, smn, d, scale_log2, bias_lo, bias_hi, bias,
          acc, l_i, m_i, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, SKIP_EMPTY: tl.constexpr):
    """One key block `cols` folded into a block of rows' running (acc, sum, max), flash attention's update.
    SKIP_EMPTY: the block's K/V are read only when some row sees one of its keys (a branch on the mask's load)."""
    in_cache = cols < n_keys
    seen = tl.load(m_row[:, None] + cols[None, :] * smn, mask=row_ok[:, None] & in_cache[None, :], other=0) != 0
    fold = True
    if SKIP_EMPTY:
        fold = tl.max(tl.max(seen.to(tl.int32), 1), 0) > 0
    if fold:
        # K and V loaded together, so their latencies overlap
        k = tl.load(k_base + cols[:, None] * skn + d[None, :], mask=in_cache[:, None], other=0.0)
        v = tl.load(v_base + cols[:, None] * svn + d[None, :], mask=in_cache[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        if HAS_BIAS:
            span = (cols >= bias_lo) & (cols < bias_hi)  # [BLOCK_N]
            s += tl.where(span[None, :], bias[:, None], 0.0)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet: exp2(-inf) = 0
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s - m_use[:, None])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)  # [BLOCK_M, D]
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    return acc, l_i, m_i


def _attention_kernel(Q, K, V, M, O, WS, CNT, BIAS, END, n_q, n_keys, scale_log2, bias_lo, bias_hi,
                      sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, smb, smm, smn, sob, som, soh,
                      KV_HEADS: tl.constexpr, GROUPS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, KEY_BLOCKS: tl.constexpr, SCAN: tl.constexpr, PRECISION: tl.constexpr,
                      SPLIT_N: tl.constexpr, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, DENSE: tl.constexpr,
                      HAS_END: tl.constexpr):
    """Grid (batch * KV_HEADS, cdiv(n_q * GROUPS, BLOCK_M), SPLITS). Row r of a program's block is query row
    r // GROUPS with query head kv_head * GROUPS + r % GROUPS; split s walks keys [s * SPLIT_N, (s+1) * SPLIT_N).
    HAS_BIAS: keys bias_lo..bias_hi-1 get BIAS[head] (fp32, log2 units) added to their scores. HAS_END: END[batch
    row] bounds the keys any of its query rows sees (the caller's word), read instead of the scan."""
    b = tl.program_id(0) // KV_HEADS
    h = tl.program_id(0) % KV_HEADS
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] (query row, head of the group) pairs
    qi = rows // GROUPS
    head = h * GROUPS + rows % GROUPS
    row_ok = qi < n_q
    d = tl.arange(0, D)
    m_row = M + b * smb + qi * smm  # [BLOCK_M] mask row starts
    n_end = n_keys
    if HAS_END:  # one load instead of the scan's pass over the mask
        n_end = tl.minimum(tl.load(END + b).to(tl.int32), n_keys)
    elif SCAN:
        # one past the last key any row of this block sees (loads without branches, so they overlap)
        end = tl.zeros([BLOCK_M], tl.int32)
        for j in tl.static_range(KEY_BLOCKS):
            cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
            seen = tl.load(m_row[:, None] + cols[None, :] * smn, mask=row_ok[:, None] & (cols[None, :] < n_keys),
                           other=0)
            end = tl.maximum(end, tl.max(tl.where(seen != 0, cols[None, :] + 1, 0), 1))
        n_end = tl.max(end, 0)
    split = tl.program_id(2)
    # splits that hold a seen key; at least one, so that a block of rows that sees nothing still writes its zeros
    n_split = tl.maximum((n_end + SPLIT_N - 1) // SPLIT_N, 1)
    if split < n_split:
        q = tl.load(Q + b * sqb + head[:, None] * sqh + qi[:, None] * sqm + d[None, :], mask=row_ok[:, None],
                    other=0.0)
        k_base = K + b * skb + h * skh
        v_base = V + b * svb + h * svh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scaled scores (log2 units)
        l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        bias = l_i  # unused without HAS_BIAS
        if HAS_BIAS:
            bias = tl.load(BIAS + head, mask=row_ok, other=0.0)  # [BLOCK_M]
        start = split * SPLIT_N
        stop = tl.minimum(start + SPLIT_N, n_end)
        if DENSE:  # every block up to the end: K/V loads issued with the mask's, a loop Triton can pipeline
            for blk in tl.range(start, stop, BLOCK_N):
                cols = blk + tl.arange(0, BLOCK_N)  # [BLOCK_N]
                acc, l_i, m_i = _fold(q, k_base, v_base, m_row, cols, row_ok, n_keys, skn, svn, smn, d, scale_log2,
                                      bias_lo, bias_hi, bias, acc, l_i, m_i, HAS_BIAS, PRECISION, False)
        else:
            while start < stop:
                cols = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
                acc, l_i, m_i = _fold(q, k_base, v_base, m_row, cols, row_ok, n_keys, skn, svn, smn, d, scale_log2,
                                      bias_lo, bias_hi, bias, acc, l_i, m_i, HAS_BIAS, PRECISION, True)
                start += BLOCK_N
        o_ptr = O + b * sob + qi[:, None] * som + head[:, None] * soh + d[None, :]
        if SPLITS == 1:
            tl.store(o_ptr, (acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]).to(O.dtype.element_ty),
                     mask=row_ok[:, None])
        else:
            if n_split == 1:  # the keys in use fit one split: as without splitting
                tl.store(o_ptr, (acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]).to(O.dtype.element_ty),
                         mask=row_ok[:, None])
            else:
                # this split's running state to the workspace [programs, SPLITS, BLOCK_M, D + 2] (acc, max, sum);
                # the split that arrives last (the counter) folds them all in and resets the counter for the next
                # call, so no other kernel (and no memset) runs in between
                prog = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
                r = tl.arange(0, BLOCK_M)
                ws = WS + ((prog * SPLITS + split) * BLOCK_M + r) * (D + 2)  # [BLOCK_M] row starts
                tl.store(ws[:, None] + d[None, :], acc)
                tl.store(ws + D, m_i)
                tl.store(ws + D + 1, l_i)
                tl.debug_barrier()  # every thread's stores issued before the counter moves (release, below)
                arrived = tl.atomic_add(CNT + prog, 1, sem="acq_rel")
                if arrived == n_split - 1:
                    m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
                    l_all = tl.zeros([BLOCK_M], tl.float32)
                    acc_all = tl.zeros([BLOCK_M, D], tl.float32)
                    for part in range(0, n_split):  # (not `j`: the scan above left j a constexpr)
                        wj = WS + ((prog * SPLITS + part) * BLOCK_M + r) * (D + 2)
                        m_j = tl.load(wj + D, cache_modifier=".cg")  # .cg: from L2, where the other splits wrote
                        l_j = tl.load(wj + D + 1, cache_modifier=".cg")
                        a_j = tl.load(wj[:, None] + d[None, :], cache_modifier=".cg")
                        m_new = tl.maximum(m_all, m_j)
                        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                        c_old = tl.math.exp2(m_all - m_use)
                        c_j = tl.math.exp2(m_j - m_use)
                        acc_all = acc_all * c_old[:, None] + a_j * c_j[:, None]
                        l_all = l_all * c_old + l_j * c_j
                        m_all = m_new
                    tl.store(o_ptr, (acc_all / tl.where(l_all == 0.0, 1.0, l_all)[:, None]).to(O.dtype.element_ty),
                             mask=row_ok[:, None])
                    tl.atomic_xchg(CNT + prog, 0)


if triton is not None:
    # with TRITON_INTERPRET=1 set before Triton's import, triton.jit gives the interpreter's version (CPU tensors)
    _fold = triton.jit(_fold)
    _attention_kernel = triton.jit(_attention_kernel)

# per device, the split kernel's arrival counters (int32, all zero between calls: the last split resets its own).
# Allocated outside CUDA-graph capture (the engine and the bench run a round before capturing it) and kept for the
# process, so a captured graph keeps a valid address; a larger need allocates anew and keeps the old buffer alive.
_COUNTERS: dict = {}
_RETIRED: list = []
MAX_SPLITS = 16
_LANES = [""]  # the counter lane of the calls made now (`counter_lane`); "" for the rounds


@contextlib.contextmanager
def counter_lane(name: str):
    """Split launches inside use counters of their own (per device and lane). Why: the counters are shared by every
    split launch of a lane, which is safe only while those launches run one after another; the row prefill's forward
    can run on a side stream beside a round (`RowPrefill.ahead`), so it takes its own lane. A captured graph keeps
    the counters of the lane it was captured in."""
    _LANES.append(name)
    try:
        yield
    finally:
        _LANES.pop()


def _counters(device, n: int) -> torch.Tensor:
    key = (str(device), _LANES[-1])
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("triton_attention: the split kernel's counters must be allocated before CUDA-graph "
                               "capture; run the attention once eagerly first (the engine does)")
        if buf is not None:
            _RETIRED.append(buf)  # a captured graph may still point at it
        _COUNTERS[key] = buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return buf


def split_plan(n_keys: int, block_n: int, split_n: int) -> tuple[int, int]:
    """(keys per split, splits) for a cache of `n_keys` slots: `split_n` keys a split (0: no split), rounded up to
    whole key blocks and widened so that there are at most MAX_SPLITS."""
    if split_n <= 0 or split_n >= n_keys:
        return max(n_keys, 1), 1
    per = -(-split_n // block_n) * block_n
    per = max(per, -(-n_keys // (MAX_SPLITS * block_n)) * block_n)
    return per, -(-n_keys // per)


def _launch(query, key, value, mask, scale, mode, block_n, num_warps, split_n=0, bias=None, bias_lo=0, bias_hi=0,
            block_m=0, num_stages=0, key_end=None):
    b, heads, n_q, d = query.shape
    kv_heads, n_keys = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    mask = mask.expand(b, 1, n_q, n_keys)  # a mask broadcast over the batch keeps stride 0
    out = torch.empty(b, n_q, heads, d, dtype=query.dtype, device=query.device)  # [b, q, heads, d]: HF's layout
    if block_m <= 0:  # (query row, head) pairs a program: all of them, 16 to 64
        block_m = min(64, max(16, triton.next_power_of_2(n_q * groups)))
    per, splits = split_plan(n_keys, block_n, split_n)
    grid = (b * kv_heads, triton.cdiv(n_q * groups, block_m), splits)
    programs = grid[0] * grid[1]
    if splits > 1:  # [programs * splits * block_m, d + 2] fp32: each split's acc, running max and sum
        ws = torch.empty(programs * splits * block_m * (d + 2), dtype=torch.float32, device=query.device)
        cnt = _counters(query.device, programs)
    else:  # unused by the kernel
        ws = cnt = out
    kw = {"num_warps": num_warps} if query.is_cuda else {}
    if num_stages > 0 and query.is_cuda:
        kw["num_stages"] = num_stages
    has_bias = bias is not None and bias_hi > bias_lo
    if has_bias:  # natural-log logits -> the kernel's log2 units, one fp32 value per query head
        bias = (bias.float() * math.log2(math.e)).contiguous()
    # unit strides of the head dim are assumed (what transformers' projections give); checked by the caller
    has_end = key_end is not None and mode != "skip"
    _attention_kernel[grid](query, key, value, mask, out, ws, cnt, bias if has_bias else out,
                            key_end if has_end else out, n_q, n_keys,
                            scale * math.log2(math.e), int(bias_lo), int(bias_hi),
                            query.stride(0), query.stride(1), query.stride(2),
                            key.stride(0), key.stride(1), key.stride(2),
                            value.stride(0), value.stride(1), value.stride(2),
                            mask.stride(0), mask.stride(2), mask.stride(3), out.stride(0), out.stride(1), out.stride(2),
                            KV_HEADS=kv_heads, GROUPS=groups, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
                            KEY_BLOCKS=triton.cdiv(n_keys, block_n), SCAN=mode in ("scan", "dense"),
                            PRECISION="ieee" if query.dtype == torch.float32 else "tf32", SPLIT_N=per,
                            SPLITS=splits, HAS_BIAS=has_bias, DENSE=mode == "dense", HAS_END=has_end, **kw)
    return out


@torch.library.custom_op("hf_carryover::masked_gqa_attention", mutates_args=())
def masked_gqa_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                         scale: float, mode: str = "scan", block_n: int = 128, num_warps: int = 4,
                         split_n: int = 0, bias: torch.Tensor | None = None, bias_lo: int = 0,
                         bias_hi: int = 0, block_m: int = 0, num_stages: int = 0,
                         key_end: torch.Tensor | None = None) -> torch.Tensor:
    """query `[b, heads, q, d]`, key/value `[b, kv_heads, L, d]`, boolean mask `[b or 1, 1, q, L]` ->
    `[b, q, heads, d]`. An opaque op to torch.compile (inductor calls it as it is) and capturable in CUDA graphs.
    split_n: keys per split (`split_plan`; 0: one program walks all the keys of its rows). bias `[heads]`: added to
    the logits (after scaling) of keys bias_lo..bias_hi-1, per query head (the drafter's carryover gate), as an
    additive mask would be. block_m: (query row, head) pairs a program (a power of two >= 16; 0: all of a K/V
    head's pairs, 16 to 64); num_stages: Triton's software pipelining of the `dense` walk (0: Triton's default).
    key_end `[b]` (int): per batch row, one past the last key any of its query rows sees, or more (an upper bound,
    the caller's promise and not checked: the kernel walks whole key blocks up to it, so a smaller value drops the
    seen keys of the blocks past it); read instead of the `scan` and `dense` modes' pass over the mask (`skip`
    ignores it)."""
    return _launch(query, key, value, mask, scale, mode, block_n, num_warps, split_n, bias, bias_lo, bias_hi,
                   block_m, num_stages, key_end)


@masked_gqa_attention.register_fake
def _(query, key, value, mask, scale, mode="scan", block_n=128, num_warps=4, split_n=0, bias=None, bias_lo=0,
      bias_hi=0, block_m=0, num_stages=0, key_end=None):
    b, heads, n_q, d = query.shape
    return query.new_empty(b, n_q, heads, d)


def check_settings(mode: str, block_n: int, prefix: str = "", split_n: int = 0, block_m: int = 0) -> str | None:
    """None when (mode, block_n, split_n, block_m) are kernel settings; otherwise what is wrong, the names read with
    `prefix` (the engine's arguments are `attention_mode` / `attention_block_n` / `attention_split_n` /
    `attention_block_m`)."""
    if mode not in MODES:
        return f"{prefix}mode={mode!r}: one of {MODES}"
    if block_n < 16 or block_n & (block_n - 1):
        return f"{prefix}block_n={block_n}: a power of two >= 16"
    if split_n < 0:
        return f"{prefix}split_n={split_n}: keys per split, >= 0 (0: no split)"
    if block_m and (block_m < 16 or block_m & (block_m - 1)):
        return f"{prefix}block_m={block_m}: a power of two >= 16 (0: all of a K/V head's rows, 16 to 64)"
    return None


def check_inputs(query, key, value, mask, mode="scan", block_n=128) -> str | None:
    """None when `masked_gqa_attention` takes these inputs; otherwise what it does not take (the caller then uses
    SDPA)."""
    why = available(query.device) or check_settings(mode, block_n)
    if why is not None:
        return why
    if mask is None or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
        return "the kernel takes a boolean mask [b, 1, q, keys]"
    d = query.shape[-1]
    if d < 16 or d & (d - 1):
        return f"head_dim={d}: a power of two >= 16"
    if query.shape[1] % key.shape[1]:
        return "query heads are not a multiple of the K/V heads"
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32) or not query.dtype == key.dtype == value.dtype:
        return f"dtypes {query.dtype}/{key.dtype}/{value.dtype}: one of float16, bfloat16, float32 for all three"
    if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        return "the head dim must be contiguous"
    return None


__all__ = ["MODES", "available", "check_inputs", "check_settings", "masked_gqa_attention"]
