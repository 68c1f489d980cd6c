"""Fast decoding engine: static caches, fixed shapes, batched rows that advance independently.

Every round, for all b rows at once:
  1. the drafter drafts one block at each row's anchor (committed context visible by position, plus the
     fixed-size carryover buffer with a validity mask);
  2. the target verifies exactly k+1 tokens per row `[anchor, d_1..d_k]` through its own HF forward, with a
     position-indexed static cache (`TargetStaticCache`) and a by-position causal mask;
  3. per row: greedy acceptance (leading matches of the target's argmax) or lossless speculative sampling;
  4. the drafter's context cache receives all k+1 verified rows at their positions (rows past the accepted
     prefix stay invisible and are overwritten later); rows a+1..k become the next round's carryover (rows past a
     drafted EOS excepted: generate() never verifies those).
With `prompt_lookup_num_tokens=N` (context lookup, as in the generate() path) a row whose committed sequence ends
in a 3- or 4-gram seen earlier proposes the tokens that followed it instead of its drafted block
(`generation_carryover.batched_context_lookup`, the generate() path's own rule, run on the device); slots past a
shorter lookup are marked invalid, so they are never accepted. Without a drafter this is prompt-lookup decoding.
A round cannot skip the drafter for some rows (fixed shapes), but when every unfinished row will look up, the whole
round runs without it (a second captured variant): each round ends by computing the next round's lookup, and the
host's one read per round fetches two flags, "all rows done" and "all rows look up". At batch 1 that skips the
drafter in every looked-up round, as the generate() path does.
No tensor changes shape between rounds; rollback is moving a row's position. Without a drafter the same loop
is plain autoregressive decoding (k = 0). A round reads and writes only the static tensors of a `DecodeState`
(and the caches) in place, so the same code runs eagerly and, with `cuda_graphs=True` on CUDA, as one replayed
CUDA graph per round (`graphs.py`), greedy or sampled: a sampled round takes its uniforms from the state, drawn
from the call's generator before each round, and turns them into tokens by inverse CDF (`inverse_cdf`).
Sampling supports temperature only (no top-k/top-p/penalties yet); greedy needs no processors.
Continuous batching (`generate(..., batch_size=b)`): more prompts than rows; the per-row done flags come back with the
round's one read, and a finished row is read out and refilled with the next prompt (`refill.py`) between rounds.
Beside this file: the decoding call (`generate()`: prefill, round launches, read-outs and refills; `loop.py`), the
linear round itself (`linear_round.py`), the static state a round works on (`state.py`),
draft-tree rounds (`tree_round.py`, on `tree.py`'s pieces), phase timing for the latency model (`timing.py`),
capture (`graphs.py`; which round runs compiled or replayed, per shape: `capture.py`), torch.compile's settings
(`compiling.py`), the caches (`static_cache.py`), the target's attention while decoding (`attention.py`) and the
choice between kernel and SDPA for plain steps by their keys in use (`one_row.py`).
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from .attention import (KEY_END, TRITON_ATTENTION, check_attention, drafter_kernel, engine_attention,
                        use_drafter_kernel)
from .capture import CapturedRounds, _is_cuda  # (tests patch `engine._is_cuda` to pretend a GPU)
from .compiling import check_inductor_options  # (re-exported: drafters' tree rounds)
from .triton_attention import available as triton_available
from .triton_attention import check_settings as check_triton_settings
from .gated_mlp import GatedMLPs
from .graphs import install_output_hooks
from .linear_round import LinearRounds
from .loop import DecodeLoop
from .one_row import resolve_keys
from .rope_table import build_rope_tables, use_rope_tables
from .sampling import inverse_cdf, point_mass, running_mass
from .state import DecodeState
from .static_cache import DrafterStaticCache, TargetStaticCache
from .timing import predicted_speedup
from .tree_round import TreeRounds
from .vocab_topk import available as vocab_topk_available


# Cache length granularity: caches and masks of a multiple of 64 slots keep the attention kernels' rows aligned
# whatever the prompt lengths. A precaution, not a measured cure: on the H200 (bf16, compiled, CUDA graphs, batch 1,
# one pass of 10 MT-Bench prompts each) the linear round read 753 tok/s with 454 slots, 617 with 581, 695 with 640
# (581 rounded up) and 757 with 512 (examples/results/h200-2026-12-01f); length and alignment were not separated.
MAX_LEN_ALIGN = 64


class SpeculativeEngine(DecodeLoop, CapturedRounds, LinearRounds, TreeRounds):
    def __init__(self, target, drafter=None, max_len: int = 2048, profile: bool = False, cuda_graphs: bool = False,
                 compile: bool | str = False, lookup_skips_drafter: bool = True, compile_options: dict | None = None,
                 lookup_siblings: bool = True, lookup_confidence: float | None = None, lookup_min_ngram: int = 3,
                 attention: str = "auto", attention_mode: str = "dense", attention_block_n: int = 128,
                 attention_warps: int = 4, attention_split_n: int = 256, attention_min_rows: int | None = None,
                 attention_block_m: int = 16, attention_one_row_keys: int | str | None = "auto",
                 run_ahead: bool = True, tree_topk: str = "ranked", draft_topk: str = "auto",
                 drafter_attention: str = "auto",
                 rope_table: bool | str = "auto", dynamic_prefill: bool = True, prefill_ahead: bool | int = True,
                 gemv_rows: int | str = "auto", gemv_fusion: bool | str = False, skinny_rows: int = 0,
                 gated_mlp: bool = False, attention_key_end: bool = False, fused_linear_rows: int | str = "auto"):
        """profile=True synchronises around the draft and verify phases and sums their wall time in
        `self.timing` (seconds: draft, verify, other) — for the latency model, at the cost of extra syncs.

        cuda_graphs=True replays each round as one captured CUDA graph (`graphs.py` lists what was checked for
        capture safety), greedy and sampled rounds each captured once per shape. It applies on CUDA without
        profiling; otherwise the call runs eagerly. `self.last_mode` says how the last `generate()` ran: "eager",
        "cuda_graph", "eager (no CUDA)", "eager (profile)", "eager (nothing to decode)" or "eager (capture failed:
        <error>)" (warned once per shape: a failed shape is not captured again).

        compile=True runs each round through `torch.compile` (inductor, static shapes; the row prefill too, `refill.py`,
        see dynamic_prefill; the batched eager prefill is not compiled):
        its fused kernels replace the dozens of small ones an HF decoder layer launches (unfused RMSNorm, RoPE,
        SiLU*up), which is where a batch-1 step of a small target spends its time. With cuda_graphs the compiled
        round is what gets captured, and `last_mode` gains "+compile". Compiled kernels may round differently
        from eager ones, so greedy output can differ at near-ties; `trainer/gpu_engine_check.py --compile`
        compares it with eager decoding. A shape compiles once (first call), like a capture. Sampled rounds are
        compiled and captured too: their uniforms come from the call's `torch.Generator` outside the round, the
        same stream in every mode, so a seed gives the eager round's tokens (tested on CPU with compile; a graph
        replays the eager round's kernels, which `trainer/gpu_engine_check.py` compares on the GPU).
        A string instead of True names another `torch.compile` backend: "aot_eager" traces the same graphs without
        inductor's code generation (most of a CPU compile's time): the quick way to debug a compile, and the tests'.

        compile_options: inductor options for the compiled rounds, on top of `combo_kernels=True` (e.g.
        {"freezing": True}: the weights are compiled in as constants, so projections that read the same input can
        be merged into one GEMM. Inductor's own pattern merges only equal widths (on the H200 with torch 2.11 it
        merged gate/up, 8-10 % faster rounds, examples/results/h200-2026-12-02d), so the engine adds its pass
        `fuse_projections.FuseSharedInputMatmuls` (`self.fused_projections`), which merges q/k/v of grouped-query
        attention too, and writes RoPE's `rotate_half` concatenation as indexing (`rotate_half.py`: same values, no
        kernels writing halves); naming "post_grad_custom_pre_pass" in the options replaces it (None: off). On CPU
        inductor packs the weights for oneDNN instead, and merges them itself with "cpp.enable_concat_linear". With
        freezing the compiled rounds keep the weights they were compiled with (the merged ones as copies): build a new
        engine after changing them. Their tokens are compared with eager decoding as for any compiled round (tested on
        CPU). {"triton.enable_pdl": True}: inductor's programmatic dependent launch (Hopper and newer), each generated
        kernel starting while the one before it finishes; `gemv_rows` then loads each weight ahead of the kernel's wait
        where inductor lets a load precede it (`fuse_projections.py`). Not a default: on an H100 it made a plain
        step 3.9 % cheaper and a tree round 3.9 % dearer, and changed the bf16 texts
        (`examples/results/h100-2026-12-06b`).

        lookup_skips_drafter=True (with context lookup): a round in which every unfinished row looks up runs without
        the drafter (its drafted block would be discarded anyway; output and rounds are the same either way, tested).
        False drafts in every round, which is what the benchmark compares against. `self.skipped_drafts` counts the
        last call's rounds that skipped it.

        lookup_siblings=True (tree rounds with context lookup): a looked-up token's siblings propose the drafter's
        ranking without that token (`tree.node_ranks`). False gives them their own ranks (before 2026-12-02), so a
        first choice the lookup displaced is verified nowhere; kept for paired τ comparisons (`evaluate_tau.py`).

        lookup_confidence=c (dynamic trees, `tree_nodes`, with context lookup): a looked-up token is scored like a
        drafted one whose drafter probability is at least c (`tree.lookup_chain_lp`), and the lookup is kept only as
        deep as it outscores the drafter's alternatives. None (the default) keeps the whole lookup (up to the round's
        nodes), which measured best (`tree.lookup_chain_lp`); both are exact, the option stays for τ comparisons.

        lookup_min_ngram=n (context lookup): the shortest suffix that may match (the longest tried is 4); 3 is
        generate()'s rule; 2 finds more lookups, each less often right (`examples/results/cpu-2026-12-03`).

        attention="triton": the target's attention in rounds and row prefills runs through
        `triton_attention.masked_gqa_attention`, which reads only the cached keys some query row sees, instead of
        SDPA over the whole `max_len` cache ("sdpa", `attention.py`). Its settings: `attention_mode` ("dense": find
        the last seen key first, then fold in every key block up to it; "scan": the same, but a block nobody sees is
        skipped, its K/V loads waiting on its mask's; "skip": walk the whole cache, skipping such blocks),
        `attention_block_n` (keys per block), `attention_warps`, `attention_split_n` (keys per split: the keys in use
        are cut into parts of that many, each walked by its own program at the same time, and the last to finish folds
        their results together; 0: one program walks them all) and `attention_block_m` ((query row, head) pairs a
        program; 0: all of a K/V head's, up to 64). It needs Triton and a CUDA target (the CPU tests run it in
        Triton's interpreter). The defaults were the fastest of 14 settings at 47 query rows on the H200
        (`trainer/gpu_attention_bench.py`, `examples/results/h200-2026-12-04d`; the measurements behind every
        setting are in `triton_attention.py`'s docstring).
        "auto" (the default) takes "triton" for a bf16 or fp16 target on CUDA when Triton is installed, else "sdpa":
        in fp32 the kernel is exact (no TF32) but slow, so fp32 targets stay on SDPA.
        `attention_min_rows`: calls with fewer query rows go to SDPA. "auto" sets 2, so plain decoding steps (one row)
        stay on SDPA, whose cost at one row hardly depends on the cache, while the kernel's grows with the keys in use;
        at the benchmarks' short contexts the kernel for one-row steps (attention_min_rows=1) was faster end to end
        (4-5 % in `h200-2026-12-04e`, 6.8 % with gemv_rows=1 in `h200-2026-12-05g`, 5.2 % on an H100), but over 1900
        tokens decoded after short prompts it was 6.3 % slower (12-05g), so by default one-row steps are chosen by
        their keys in use (next). attention="triton" sets 1.
        `attention_one_row_keys=N`: one-row steps run on the kernel while every row attends to at most N keys, and
        on SDPA after that (`one_row.py`: two variants of the plain step, chosen by the host from a bound it counts
        itself, no device read). It needs the kernel (attention "triton", or "auto" taking it) and leaves
        `attention_min_rows` at 2. "auto" (the default) sets 512 for calls of up to 8 rows where attention "auto" took
        the kernel and `attention_min_rows` is unset, else off (None): batch-1 plain decoding was 8.2 % faster at
        about 200 keys in use on the H200 (`h200-2026-12-06`), 4.1-5.4 % at 200-250 and 0.5 % slower at about 1010
        on an H100 (`h100-2026-12-05h`); batch 8 was 1.7 % faster on the H200 (`one_row.py`).
        SDPA at one row (cuDNN) is not run-to-run deterministic in bf16 on the H200 (12-03d's
        `pass_determinism.txt`); attention="triton" gives reproducible bf16 plain decoding.
        `attention_key_end=True` (only where the target's attention is the kernel, else refused; default False): each
        target forward hands the kernel every row's last written slot + 1 as the end of its keys in use (`_key_end`), so
        it skips its first pass over the mask (`triton_attention.masked_gqa_attention(key_end=...)`). Same keys, same
        values but where the end moves a key split (bf16 sums then fold in another order). Timed alone on an H100 (one
        layer, the reference target's shapes, `trainer/gpu_attention_bench.py`, `h100-2026-12-06e`): 32 query rows 4.94
        -> 4.60 us at batch 1 and 7.71 -> 7.15 at batch 8 (200 committed keys), one row 4.88 -> 4.45 and 5.87 -> 5.35.
        End to end it was not measurable: a tree 31 + lookup round on 80 HumanEval prompts took 1.410 ms with it against
        1.405 without (another machine start of the same H100 kind; the same tokens). That run's row prefill took the
        end as a reduction over its dynamic width, which inductor refused on the GPU (it fell back to per-width
        compiles); it now indexes the last position instead, not yet compiled on a GPU. So it is off.

        run_ahead=True: the decode loop keeps one round queued ahead of its one read per round (`graphs.run_ahead`),
        so the GPU does not wait for the host between rounds; each call then runs one round more than it needs (a
        no-op for finished rows). With continuous batching a refilled row idles the one round queued before its
        refill. Not with the drafter-skipping lookup variant, phase timing or a `round_hook`: there the next round
        depends on what the host reads. False: the blocking loop. `self.last_launched` counts the rounds launched.

        drafter_attention="triton" (with attention="triton"): the drafter's attention in rounds runs through the same
        kernel, which reads only its keys in use (`attention.DrafterKernel`); "sdpa": SDPA over its whole cache;
        "auto" (the default): the kernel where the target's attention is on it and the drafter's code has the hook,
        else SDPA. With the "dense" defaults a tree 31 + lookup round cost 1.606 against 1.648 ms on 80 HumanEval
        prompts (`h200-2026-12-04e`). The drafter only proposes: its attention can change τ, never the output.

        tree_topk="ranked" (the default): dynamic trees pick their nodes without topk and sort launches
        (`tree.best_ids`); "torch": with them. draft_topk="triton": tree rounds rank the drafter's tokens over the
        vocabulary with `vocab_topk.py`'s two launches instead of torch's log_softmax and radix topk (CUDA, or Triton's
        interpreter; ranks up to 64); "auto" (the default): that on CUDA where Triton is installed; "torch": torch.
        Either choice gives the same nodes and tokens but for ties. On an H100 (the reference target's shapes, tree 31
        + lookup, `h100-2026-12-06c`) a captured round took 1.431 ms with neither, 1.336 with draft_topk="triton" and
        skinny_rows=64, 1.323 with tree_topk="ranked" as well (skinny_rows' share: none on the real target, below).

        rope_table="auto" (the default): the target's and the drafter's RoPE cos/sin are read by position from tables
        of their rotary modules' own values (`rope_table.py`), so a compiled round's layers load them instead of each
        recomputing them; a RoPE that cannot be tabled (sequence-dependent frequencies, one per layer type) is computed
        as usual, its reason in `self.rope_untabled`. True: such a model is refused by name; False: no tables. A tree
        round 1.505 against 1.615 ms on the H200 (`h200-2026-12-04f`, two machine starts); plain steps unchanged. The
        tables are built here from the modules as they are, as compiled rounds freeze the weights they see.

        dynamic_prefill=True (the default; with compile): the row prefill compiles once with the prompt's width left
        dynamic, instead of once per width bucket (each as long as a round's compile); still one CUDA graph per
        bucket. Should that compile fail, the prefill warns and compiles per width (`refill.py`).

        prefill_ahead=True (the default; continuous batching): the next waiting prompt's prefill forward runs early,
        on a side stream beside the rounds (`RowPrefill.ahead`), and a refill only copies it into the freed row; the
        other rows of a refill prefill as before. Same tokens and rounds (tested on CPU, where it runs in order; fp32 on
        the H200 with CUDA graphs, greedy, tree + lookup at batch 4). On the H200 at batch 8 on 64 MT-Bench prompts it
        made a tree 31 + lookup round 3.0 % cheaper and a plain step 1.5 % (examples/results/h200-2026-12-05b).
        prefill_ahead=N (an int >= 1; True is 1): the next N waiting prompts go through one forward ahead (the row
        prefill's staging caches then hold N prompts, `refill.py`), and so do the call's first rows and any refill
        that finds nothing staged, N at a time. Why: a row prefill of the 135M target is mostly fixed cost, paid by
        every refill beside the rounds, and N prompts in one forward pay it about once. Same tokens and rounds (tested
        on CPU). On an H100 at batch 8 (64 MT-Bench prompts, one call, examples/results/h100-2026-12-05f) N=4 made a
        launched tree 31 + lookup round 1.4 % cheaper and a plain step 0.9 %; the rows' tok/s moved by their batch
        fill, which differed with their bf16 texts (tree -1.3 %, AR +2.0 %). The default stays 1 until the GPU's fp32
        check has run with N=4.

        gemv_rows=N (with compile and freezing): every frozen-weight GEMM of at most N rows (N=1: a batch-1 plain
        step) is generated by inductor as a float32 multiply-and-sum reduction instead of a cuBLAS call, so it can
        fuse with its neighbours (`fuse_projections.py`). 0: off. A batch-1 plain step of SmolLM2-135M (bf16, 20
        MT-Bench prompts) was 8.8 % cheaper on the H200 (1.040 -> 0.948 ms, examples/results/h200-2026-12-05b) and
        8.7 % on an H100 (1.036 -> 0.946 ms, examples/results/h100-2026-12-05f), 9.6 % in h200-2026-12-05g. The fp32
        check of compiled rounds passed with it there (gemv_rows=1 with gemv_fusion="norms", plain steps and drafted
        rounds); the CPU tests check every variant compiled in float64. More rows lose: a tree 31 + lookup round cost
        2.196 ms with gemv_rows=16 and 5.212 ms with 32, against 1.475 ms with 1 (12-05g, HumanEval), probably because
        the reduction reads each weight once per row (not profiled).
        "auto" (the default): 1 where that was measured, a CUDA target of hidden size <= 1024 compiled with
        `compile_options={"freezing": True}` and the pass's slot left to the engine; else 0 (no error). Why not
        wider: on CPU, and for wider projections (a 4B target's), a generated reduction has not been timed against
        the library GEMV, so those keep it. An explicit N asks for it anywhere and is refused without freezing.
        `self.gemv_rows` holds what was chosen.

        gemv_fusion=True (with gemv_rows; default False): an RMSNorm that makes a rewritten GEMM's input is computed
        inside the reduction (its mean recomputed for every output column), and a merged gate/up GEMM becomes two
        reductions of one width, so inductor generates norm + projection as one kernel where it launched two: a
        batch-1 plain step of the 135M target generates 227 launches against 285 with gemv_rows=1 alone
        (`examples/kernel_census.py`, a CPU proxy under the GPU's realization rules; examples/results/cpu-2026-12-05e).
        Timed on an H100 it lost: a plain step took 1.034 ms with it against 0.960 without (gemv_rows=1, bf16, 20
        HumanEval prompts, one call; examples/results/h100-2026-12-05d), so it is off. It stays for further study.
        gemv_fusion="norms": the norms only, gate/up left one reduction (224 launches on the same proxy), as there the
        folded reductions stay persistent (the input loaded once) where the split gate/up became a looped one. It lost
        too: on an H100 a plain step took 0.973 ms with it against 0.899 without (both with gemv_rows=1 and
        attention_min_rows=1, one call; examples/results/h100-2026-12-05f). Fewer launches did not make up for
        recomputing each norm's mean in every output column's program.

        skinny_rows=N (with compile and freezing; default 0, off): frozen-weight GEMMs of more than gemv_rows and at
        most N rows (up to 64) and at most 1024 output columns run on `skinny_gemm.py`'s Triton kernel instead of
        cuBLAS (a tree round's verify and drafter projections; `fuse_projections.py` says what was timed). It is
        fp32-exact on the GPU, but on the real target it saved nothing: a tree 31 + lookup round took 1.410 against
        1.418 ms on 80 HumanEval prompts and 1.363 against 1.360 on 80 MT-Bench ones (an H100, one machine start,
        `h100-2026-12-06d`), so it stays off. gated_mlp=True (with skinny_rows) also has gated SiLU MLPs compute
        SiLU(gate) * up inside their down projection's kernel (`gated_mlp.py`): that made the round 41 % dearer
        (2.004 ms; the kernel 22 against 9.8 us, `gated_mlp.py`); off, kept for study.

        fused_linear_rows=N (with compile and freezing): frozen-weight GEMMs of at most N rows (up to 64) run on
        `fused_linear.py`'s Triton kernel, each with the RMSNorm before it, or the SiLU(gate) * up or residual add
        after it, made in the same kernel where the graph has them (`fold_linears.py`): about 7 launches a decoder
        layer in place of 10. It takes these GEMMs before gemv_rows and skinny_rows do. On an H100 (random weights of
        the reference target's shapes, one machine start, `h100-2026-12-06g`) N=32 made a plain batch-1 step 11.6 %
        cheaper (0.820 against 0.927 ms) and a tree round 3.2 % dearer (1.401 against 1.358 ms), the 32-row vocabulary
        head included: alone it took 62.9 us on the kernel against 24.1 on cuBLAS (`h100-2026-12-07`), so multi-row
        GEMMs wider than `fused_linear.TILED_MAX_N` now stay on cuBLAS; with them there N=32 left the round even
        (1.359 against 1.362 ms, 314 kernels against 413, a folded GEMM 5.15 us against cuBLAS's 3.82,
        `h100-2026-12-07e`), and after the norm pass's restructure (`dc0a7fe`) 2.3 % cheaper (1.326 against 1.357 ms,
        a folded GEMM 4.86 us, `h100-2026-12-07g`); on the reference target that tree round was 2.2 % cheaper with
        N=32 too (1.339 against 1.370 ms on 80 MT-Bench prompts, 2597.5 against 2527.2 tok/s, `h100-2026-12-07h`),
        3.3 % on 80 HumanEval ones (1.366 against 1.412 ms, `h100-2026-12-07i`, where the compiled fp32 check of tree
        rounds passed with it), and at batch 8 (continuous, 64 MT-Bench prompts, `h100-2026-12-07j`) 0.2 % a launched
        round (12542.2 against 12316.0 tok/s) and 0.5 % a plain step (6280.4 against 6219.7). N=1 made a
        plain step 20.9 % cheaper on 80 MT-Bench prompts (0.725 against 0.916 ms, 1379.9 against 1091.4 tok/s) and
        20.4 % on 80 HumanEval ones (0.744 against 0.934), and N=8 made a batch-8 step 3.3 % dearer (1.288 against
        1.247 ms); the compiled fp32 check of plain steps passed with N=1 (an H100, one machine start,
        `h100-2026-12-06h`; before `dc0a7fe`). "auto" (the default) is 32 where that was timed on the real target: a
        CUDA target with Triton and frozen weights whose projections take at most 2048 inputs
        (`capture.auto_fused_linear_rows`; linear rounds untimed with it), else 0; until 2026-12-07 it was 1.
        `self.fused_linear_rows` holds what was chosen. (A late norm for the multi-row kernel lost and was removed:
        `fused_linear.py`'s docstring.)"""
        if not any(rope_table is v for v in (True, False)) and rope_table != "auto":
            raise ValueError(f"rope_table={rope_table!r}: 'auto', True or False.")
        if not isinstance(dynamic_prefill, bool):
            raise ValueError(f"dynamic_prefill={dynamic_prefill!r}: True or False.")
        self.dynamic_prefill = dynamic_prefill
        if not isinstance(prefill_ahead, int) or (not isinstance(prefill_ahead, bool) and prefill_ahead < 1):
            raise ValueError(f"prefill_ahead={prefill_ahead!r}: True, False or a number of prompts (an int >= 1).")
        self.prefill_ahead = prefill_ahead
        if attention not in ("auto", "sdpa", "triton"):
            raise ValueError(f"attention={attention!r}: 'auto', 'sdpa' or 'triton'.")
        if attention_min_rows is not None and int(attention_min_rows) < 1:
            raise ValueError(f"attention_min_rows={attention_min_rows}: at least 1 (None: 2 under 'auto', else 1).")
        auto = attention == "auto"
        if auto:
            half = target.dtype in (torch.float16, torch.bfloat16)
            attention = ("triton" if half and _is_cuda(target.device) and triton_available(target.device) is None
                         else "sdpa")
        self.attention = attention
        # (None, or the keys bound; "auto": 512 for calls of up to 8 rows where "auto" took the kernel,
        # `one_row.resolve_keys`)
        attention_one_row_keys, self.one_row_max_rows = resolve_keys(attention_one_row_keys, attention, auto,
                                                                     attention_min_rows)
        self.attention_one_row_keys = attention_one_row_keys
        min_rows = (int(attention_min_rows) if attention_min_rows is not None
                    else 2 if auto or attention_one_row_keys else 1)
        self.attention_settings = {"mode": attention_mode, "block_n": int(attention_block_n),
                                   "num_warps": int(attention_warps), "split_n": int(attention_split_n),
                                   "block_m": int(attention_block_m), "min_rows": min_rows}
        if not isinstance(attention_key_end, bool):
            raise ValueError(f"attention_key_end={attention_key_end!r}: True or False.")
        if attention_key_end and attention != "triton":
            raise ValueError("attention_key_end=True hands the Triton attention kernel the end of the keys in use, "
                             f"but this engine's attention is {attention!r} ('auto' takes the kernel for bf16/fp16 "
                             "CUDA targets with Triton installed)")
        self.attention_key_end = attention_key_end
        if attention == "triton":
            why = (check_triton_settings(attention_mode, self.attention_settings["block_n"], "attention_",
                                         self.attention_settings["split_n"], self.attention_settings["block_m"])
                   or triton_available(target.device))
            if why:
                raise ValueError(f"attention='triton': {why}")
        if not 1 <= int(lookup_min_ngram) <= 4:
            raise ValueError(f"lookup_min_ngram={lookup_min_ngram}: between 1 and 4 (the longest suffix tried).")
        self.lookup_min_ngram = int(lookup_min_ngram)
        if lookup_confidence is not None and not 0.0 < float(lookup_confidence) <= 1.0:
            raise ValueError(f"lookup_confidence={lookup_confidence}: a probability in (0, 1] (None: keep the lookup).")
        self.lookup_confidence = None if lookup_confidence is None else float(lookup_confidence)
        self.lookup_skips_drafter = lookup_skips_drafter
        self.lookup_siblings = lookup_siblings
        self.skipped_drafts = 0
        self.run_ahead = bool(run_ahead)
        # one object for every call: compiled rounds guard on the drafter layers' `kernel`
        self._drafter_kernel = drafter_kernel(drafter, drafter_attention, self.attention, self.attention_settings)
        self.drafter_attention = "sdpa" if self._drafter_kernel is None else "triton"
        if tree_topk not in ("ranked", "torch"):
            raise ValueError(f"tree_topk={tree_topk!r}: 'ranked' or 'torch'.")
        self.tree_topk = tree_topk
        why = vocab_topk_available(target.device) if draft_topk != "torch" else None
        if draft_topk not in ("auto", "torch", "triton") or (draft_topk == "triton" and why):
            raise ValueError(f"draft_topk={draft_topk!r}: 'auto', 'torch' or 'triton'{f' ({why})' if why else ''}.")
        self.draft_topk = "triton" if draft_topk == "triton" or (
            draft_topk == "auto" and why is None and _is_cuda(target.device)) else "torch"
        self.last_launched = 0
        self.kernel_steps = None  # attention_one_row_keys: the last call's plain steps on the kernel
        # diagnostics (`trainer/gpu_replay_diff.py`): called with the DecodeState after every round, eager or
        # replayed; None (the default) costs nothing
        self.round_hook = None
        self.profile = profile
        self._setup_compile(compile, compile_options, gemv_rows, gemv_fusion, target, skinny_rows,
                            fused_linear_rows)  # (`capture.py`)
        self.cuda_graphs = cuda_graphs
        self.last_mode: str | None = None
        self.timing = {"draft": 0.0, "verify": 0.0, "other": 0.0, "rounds": 0}
        self.target = target  # eval mode while decoding only (`_decoding`)
        self.drafter = drafter
        # skinny_rows with gated_mlp: the MLPs' down projections read SiLU(gate) * up in their GEMM (`gated_mlp.py`)
        if not isinstance(gated_mlp, bool) or (gated_mlp and not self.skinny_rows):
            raise ValueError(f"gated_mlp={gated_mlp!r}: True or False; True runs the MLPs' down projections on "
                             f"skinny_rows' kernel, so it needs skinny_rows > 0 (here {self.skinny_rows}).")
        self.gated_mlps = GatedMLPs([target, drafter], self.skinny_rows) if self.skinny_rows and gated_mlp else None
        check_attention(target)  # flash / flex targets cannot take the rounds' 4D mask: refused now, by name
        if drafter is not None:
            drafter.bind_target(target)
            if self.compile:  # the rounds ask for hidden states: hooks in place before the first compiled call
                install_output_hooks(target)
        # the caches and every round's 4D mask span max_len keys: rounded up to a multiple of MAX_LEN_ALIGN so the
        # attention kernels read aligned rows (see MAX_LEN_ALIGN)
        self.max_len = -(-int(max_len) // MAX_LEN_ALIGN) * MAX_LEN_ALIGN
        self.rope_untabled: dict = {}  # model name -> why its RoPE is computed as usual (rope_table="auto")
        models = {"target": target, "drafter": drafter}
        self._ropes = [] if rope_table is False else build_rope_tables(
            models, self.max_len, None if rope_table is True else self.rope_untabled)
        self.rope_tabled = [] if rope_table is False else [  # the models whose RoPE rounds read from tables
            n for n, m in models.items() if m is not None and n not in self.rope_untabled]
        params = inspect.signature(target.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.24
        self.rounds: list[list[int]] = []
        self.lookup_rounds: list[list[bool]] = []
        self._steps: torch.Tensor | None = None  # arange(max_len) on the device, shared by every round
        self._caches: dict = {}  # b -> (TargetStaticCache, DrafterStaticCache | None)
        self._states: dict = {}  # (b, k, cap, n_eos) -> DecodeState
        # (b, k, cap, n_eos, ...) of a round, or ("start", state id, lookup) of a call's start -> CUDAGraph, or the
        # error text of a failed capture (`_capture_once`)
        self._graphs: dict = {}
        self._prefills: dict = {}  # (b, graphs?, slots) -> RowPrefill (the row prefill: refills and captured prefills)
        # how a call prefills its prompts: None = row by row through captured width-bucket graphs where the rounds
        # are captured (CUDA, cuda_graphs, no profiling), else one eager forward for the batch; True / False force
        # the row prefill (eager off CUDA) / the batched one (tests compare the two)
        self.row_prefill: bool | None = None

    def kernel_record(self) -> dict:
        """What a benchmark or profile row records of this engine's round kernels: the frozen pass's counts
        (`fuse_projections.py`), the gated MLPs swapped (`gated_mlp`) and the drafter's top-R path (`draft_topk`)."""
        res = self.fused_projections.record() if self.fused_projections is not None else {}
        if self.gated_mlps is not None:
            res["gated_mlps"] = len(self.gated_mlps.modules)
        return {**res, "draft_topk": self.draft_topk}

    @contextlib.contextmanager
    def attention_context(self):
        """The target's attention as this engine's rounds run it (`attention.engine_attention`): SDPA with grouped
        heads, or the Triton kernel with this engine's settings (attention="triton"); the drafter's on the kernel
        too where `drafter_attention` says so (`attention.use_drafter_kernel`); RoPE from a table with `rope_table`;
        gated MLPs through `skinny_gemm.silu_mul_mm` with `skinny_rows` and `gated_mlp` (`gated_mlp.py`)."""
        target = (engine_attention(self.target, TRITON_ATTENTION, self.attention_settings)
                  if self.attention == "triton" else engine_attention(self.target))
        with target, use_drafter_kernel(self.drafter, self._drafter_kernel), use_rope_tables(self._ropes), \
                self.gated_mlps or contextlib.nullcontext():
            yield

    # ------------------------------------------------------------------ static buffers
    def _state(self, b, k, max_new, n_eos, dev, dtype, n_noise=None) -> DecodeState:
        """The static state for this shape, allocated on first use; the caches are shared by every state of batch b.
        n_noise: uniforms per row and round where a sampled tree round needs more than a linear one's 2k+1."""
        if self._steps is None:
            self._steps = torch.arange(self.max_len, device=dev)
        if b not in self._caches:
            tc = self.target.config.get_text_config()
            hd = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
            kvh = getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads
            cache = TargetStaticCache(tc.num_hidden_layers, b, kvh, self.max_len, hd, dtype, dev, self._steps)
            dcache = None
            if self.drafter is not None:
                d, dcfg = self.drafter, self.drafter.config
                dcache = DrafterStaticCache(len(d.layers), b, dcfg.num_key_value_heads, self.max_len, dcfg.head_dim,
                                            d.fc.weight.dtype, dev)
            self._caches[b] = (cache, dcache)
        n_noise = max(n_noise or 0, 2 * k + 1)
        key = (b, k, max_new + k + 1, n_eos, n_noise)
        if key not in self._states:
            n_feat = 0
            if self.drafter is not None:  # raw target features: tapped layers concatenated, in the target's dtype
                n_feat = len(self.drafter.config.target_layer_ids) * self.target.config.get_text_config().hidden_size
            self._states[key] = DecodeState(b, k, max_new, n_eos, self._caches[b], n_feat, dtype, dev, self.max_len,
                                            n_noise)
        return self._states[key]

    # ------------------------------------------------------------------ target
    def _target_forward(self, cache, tokens, positions, slots=None, mask=None):
        """Verify `tokens` at RoPE `positions`; K/V go to cache `slots` (default: the positions; a tree round writes
        nodes of equal depth to distinct slots) and `mask` replaces the causal mask (a tree round's ancestor mask)."""
        cache.positions = positions if slots is None else slots
        mask = cache.causal_mask(positions) if mask is None else mask
        out = self.target(input_ids=tokens, position_ids=positions, attention_mask=mask,
                          use_cache=True, output_hidden_states=self.drafter is not None,
                          **{self._cache_kw: cache}, **self._key_end(cache.positions))
        feats = self.target_features(out.hidden_states) if self.drafter is not None else None
        return out.logits.float(), feats

    def target_features(self, hidden_states: tuple) -> torch.Tensor:
        """The drafter's target features `[b, n, len(ids) * d]` from an HF `hidden_states` tuple, the values of
        `Drafter.target_features`. Compiled, each tapped layer's output is assigned into a slice of one new buffer
        instead of concatenated: a layer's output is a residual sum inductor keeps unwritten, and its `cat` copies each
        into its slice in a kernel of its own placed at the graph's end, too far from the layer for inductor (64
        nodes) to fuse it into the next layer's norm kernel, which reads the same sum. The slice assignments lower to
        one pointwise kernel for all tapped layers: a tree + lookup round 412 -> 409 launches in
        `examples/kernel_census.py` (h200-2026-12-07/cpu/). Uncompiled (CUDA graphs alone) one cat kernel beats a
        copy per layer."""
        if not torch.compiler.is_compiling():
            return self.drafter.target_features(hidden_states)
        ids = self.drafter.config.target_layer_ids
        first = hidden_states[ids[0] + 1]  # layer i's output is entry i + 1 (entry 0: the embeddings)
        d = first.shape[-1]
        feats = first.new_empty(*first.shape[:-1], len(ids) * d)  # [b, n, len(ids) * d]
        for j, i in enumerate(ids):
            feats[..., j * d:(j + 1) * d] = hidden_states[i + 1]
        return feats

    def _key_end(self, slots: torch.Tensor, ordered: bool = False) -> dict:
        """The target forward's keyword for the attention kernel's `key_end` (`attention_key_end`; {} when off, so
        nothing is computed): each row's last written slot + 1, from the forward's `slots` `[b, n]` (ordered: they
        increase along each row, so the last column is the largest and no reduction is needed). Every mask the engine
        builds lets a query see only committed slots and slots its forward writes (a causal block at those positions,
        a tree's ancestors), so no query row sees a key at or past it."""
        if not self.attention_key_end:
            return {}
        return {KEY_END: (slots[:, -1] if ordered else slots.amax(1)) + 1}

    def one_row_keys(self, rows: int) -> int | None:
        """The keys bound of `attention_one_row_keys` for a call of `rows` rows (None: one-row steps stay where
        `attention_min_rows` puts them). Under "auto" calls of up to `one_row.AUTO_MAX_ROWS` rows switch."""
        too_many = self.one_row_max_rows is not None and rows > self.one_row_max_rows
        return None if too_many else self.attention_one_row_keys

    @staticmethod
    def _on_cuda(device) -> bool:
        """Whether `device` is a CUDA device, by this module's `_is_cuda` (tests pretend one by patching that)."""
        return _is_cuda(device)


__all__ = ["DecodeState", "SpeculativeEngine", "check_inductor_options", "inverse_cdf", "point_mass",
           "predicted_speedup", "running_mass"]
