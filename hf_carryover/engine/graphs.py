"""CUDA-graph capture of one engine round, greedy or sampled.

`SpeculativeEngine._round` reads and writes only static tensors (`DecodeState` plus both caches) in place, so a
`torch.cuda.CUDAGraph` recorded once replays a whole round (draft + verify + accept + state update) for every
later round and every later prompt with the same (b, k, output capacity, number of EOS ids, greedy/sampled).
The prefill is not part of the round: its shape depends on the prompt width. Where rounds are captured it runs row by
row through one graph per width bucket (`refill.py`), and it only writes into the same static tensors.

Sampling without a generator inside the graph: a sampled round reads its 2k+1 uniforms per row from
`DecodeState.noise`, which the decode loop fills from the call's `torch.Generator` before every replay (one
eager kernel), and turns them into tokens by inverse CDF. The graph holds no random op, so nothing needs
registering with it (`CUDAGraph.register_generator_state`), and the generator advances exactly as in the eager
loop: a seed gives the same tokens eagerly and replayed (`trainer/gpu_engine_check.py` compares them).

What was checked about the round's calls, by reading the installed transformers 5.24 sources (and, for ATen
ops, public copies of PyTorch's C++ source: the installed torch 2.13 wheel ships binaries only):
  * `masking_utils.create_causal_mask` -> `_preprocess_mask_arguments` returns a 4D tensor mask as-is (early
    exit, before any `find_packed_sequence_indices`, whose `.all()` would sync); our `TargetStaticCache` is not a
    `Cache` subclass, so `find_first_full_attention_index` returns 0 without looking at tensors.
  * `integrations/sdpa_attention.py`: every branch is on shapes, flags or module attributes (`q_length`,
    `attention_mask is None`, `num_key_value_groups`): with our mask it takes `repeat_kv` (k+1 > 1 queries) or
    `pack_gqa` (1 query, plain AR), never `is_causal`, and it never reads mask values.
  * `LlamaModel.forward`, the decoder layer, `capture_outputs` (hidden states are gathered by Python hooks) and
    `merge_with_config_defaults`: no tensor-valued conditions; `position_ids` are passed, so no
    `cache.get_seq_length()` arange.
  * `LlamaRotaryEmbedding` / `Qwen3RotaryEmbedding` with rope_type "default": pure ops. `dynamic_rope_update`
    compares `torch.max(position_ids) + 1` with a Python int for "dynamic" and "longrope" RoPE: a host sync,
    so such targets fail capture (and then decode eagerly, see below).
  * `torch.isin` switches to a sort-based path when the EOS list is long relative to the input (numpy's
    heuristic in ATen); the round uses a broadcast comparison instead, one fixed kernel.
  * The drafter (`modeling_drafter.py`) branches only on shapes and config; `DrafterStaticCache.length` is a
    Python int. Its GQA head repeat uses expand + reshape: `repeat_interleave` with an int count builds an index
    tensor, and some ATen versions check its values with `.item()` (a sync) before the kernel.
  * Position ranges come from one `arange` made per engine (`SpeculativeEngine._steps`) or per cache; factory
    ops with Python-scalar arguments and allocations would be capturable anyway (the graph's private pool).
What could still break capture or replay (unverified here, no GPU): SDPA kernel selection with a boolean mask
(memory-efficient or cuDNN attention) is made on shapes and dtypes, but a backend that inspects mask values,
or a cuDNN graph that allocates workspace lazily, would fail capture; attention implementations other than
"sdpa" (flash_attention_2 requires no 4D mask, flex builds a BlockMask) are not covered; models whose forward
syncs (MoE routing with `.tolist()`, dynamic RoPE) cannot be captured. A capture error falls back to eager
decoding for that call with a warning; a graph that captured a silent value-dependent branch would replay it
wrongly, which is why `trainer/gpu_engine_check.py` compares graph output with eager output token for token.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def restored(tensors: list[torch.Tensor]):
    """Clone `tensors` on entry and copy the clones back on exit (also after an error): whatever runs inside
    leaves no trace in them."""
    saved = [t.clone() for t in tensors]
    try:
        yield
    finally:
        for t, s in zip(tensors, saved):
            t.copy_(s)


def capture_round(round_fn, tensors: list[torch.Tensor], warmup: int = 3, stream=None) -> torch.cuda.CUDAGraph:
    """Record `round_fn()` into a CUDA graph, leaving every tensor in `tensors` exactly as it was.

    As PyTorch's CUDA-graph notes ask, the function first runs a few times on a side stream (lazy
    initialisation, cuBLAS workspaces, autotuning) before capture. Those warm-up rounds really decode, so the
    state and the caches are cloned first and copied back afterwards: warm-up and capture never change the
    decoding result. (Strictly, the caches would not need it — rounds write only at positions >= each row's
    anchor, and restoring the anchors hides those writes again — but a full restore does not rely on that.)

    stream: the capture stream (None: torch's shared one). Graphs captured on one stream share its cuBLAS workspace,
    so a graph that may replay beside the rounds on another stream is captured on a stream of its own (`refill.py`).
    """
    with restored(tensors):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                round_fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            round_fn()
    return graph


def install_output_hooks(target) -> None:
    """Run one token through `target` asking for its hidden states, outside any compile. Why: transformers (5.x)
    installs its hidden-state capturing hooks lazily, on the first forward that asks for hidden states. Where that
    forward is the engine's first compiled prefill or round, the installation (under a lock) breaks the compiled graph,
    and the breaks stay in the compiled code: inductor compiles it in pieces that cannot fuse across
    (`examples/compile_census.py`, `tests/test_engine_tree.py`). A real forward installs exactly the hooks the model's
    own code would; installing them by hand on every sub-model registered them twice on the decoder layers (each
    hidden state was collected twice, and the drafter read the wrong layers)."""
    ids = torch.zeros(1, 1, dtype=torch.long, device=target.device)
    with torch.no_grad():
        target(input_ids=ids, output_hidden_states=True, use_cache=False)


def run_ahead(launch, flags: torch.Tensor, on_read=None) -> int:
    """Call `launch()` (one round: a graph replay, or an eager round) until `flags[0]` ("every row done") is set,
    keeping one round queued ahead of the host: round r+1 is launched *before* the host waits for round r's flags.
    Returns the number of rounds launched.

    Why: with one blocking read per round the GPU idles while the host reads the flags, checks them and launches the
    next replay (a captured 31-node tree round on the H200: 1.583 ms back to back, 1.628 ms with a sync after each,
    `examples/results/h200-2026-12-03d`). Here round r's flags travel to pinned host memory by an asynchronous copy
    behind round r, and while the host waits for them round r+1 is already queued, so the GPU goes from one round to
    the next without a gap (the host's profile of a call then waits in `Event.synchronize`). Measured in
    `generate()` with it: 1.717 ms a tree round on HumanEval and 1.044 ms a plain step, against 1.733-1.767 and
    1.056-1.075 in 12-03c, which also lacked the one-graph compile of the round (not separated).
    The price is one round launched after the last row finished: such a round leaves every output unchanged (a
    finished row keeps its tokens, counters and anchor; rows finish at different rounds in any batch, so the rounds
    are written for it), and it costs one round of GPU time per call (~3 % of a 33-round HumanEval call). Still one
    host sync per round. Off CUDA the copies are synchronous and the same order of rounds runs (what the
    CPU tests check against the blocking loop).

    `on_read(flags_list)` (continuous batching): called with every round's flags as the host reads them (round r's,
    while round r+1 is queued); it returns True where it changed the state (finished rows read out and refilled, all
    queued without waiting: `ReadOut`, `DecodeState.stage_rows`). The refill then lands behind round r+1, which
    passed over those rows as finished rows (no-ops), so a refilled row idles for one round. The flags read so far
    are stale after it: the flags after round r+1 and the refill are posted behind it, round r+2 is queued behind
    them, and the next read takes them, so the queue never drains for a refill. (Until 2026-12-05 the loop waited for
    those flags before queueing r+2, one drained queue a refill; rows that finished in round r+1 were then refilled
    before r+2, now behind it, one idle round more for such a row.) On the H200 (`h200-2026-12-05`, call 3, one
    pass, with the draining loop): engine AR at batch 8 over 64 MT-Bench prompts, 1.272 ms a launched round against
    1.291 with the blocking loop."""
    on_cuda = flags.is_cuda
    host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=on_cuda)
    ready = torch.cuda.Event() if on_cuda else None

    def post():  # the flags of the last round queued, to the host, behind it
        host.copy_(flags, non_blocking=on_cuda)
        if ready is not None:
            ready.record()

    def wait():
        if ready is not None:
            ready.synchronize()

    def changed() -> bool:
        return on_read is not None and bool(on_read(host.tolist()))

    launched = 0
    post()
    wait()
    while True:  # nothing queued: the start, and refills before the first round (a first token that ends its row)
        if changed():
            post()
            wait()
            continue
        if bool(host[0]):  # nothing (more) to decode
            return launched
        launch()
        post()
        launched += 1
        while True:
            launch()  # round r+1, queued behind round r
            launched += 1
            wait()  # round r finished (r+1 runs on)
            if changed():
                post()  # the flags after round r+1 and the refills, read while round r+2 runs
                continue
            if bool(host[0]):
                return launched
            post()


__all__ = ["capture_round", "install_output_hooks", "restored", "run_ahead"]
