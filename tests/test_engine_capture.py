"""Fast engine plumbing (CPU): reused static buffers, CUDA-graph capture with eager stand-ins, the attention the
engine installs, and the compiled round (frozen weights, gemv_rows, rotate_half) against the eager one."""

import re
import warnings
from unittest.mock import patch

import pytest
import torch
from conftest import build_drafter, build_target
from test_engine import _greedy_refs, _prompts

from hf_carryover.engine import capture as capture_mod
from hf_carryover.engine import engine as engine_mod
from hf_carryover.engine import refill as refill_mod
from hf_carryover.engine.capture import auto_fused_linear_rows, auto_gemv_rows
from hf_carryover.engine.engine import SpeculativeEngine
from hf_carryover.engine.graphs import restored


@pytest.mark.parametrize("typ", ["dflash", "markov", None])
def test_repeated_generate_reuses_buffers_and_equals_fresh_engines(typ):
    """Long prompts first (so later, shorter calls run over stale cache positions), then other prompt lengths,
    another batch size, another budget and an EOS list: each call equals a fresh engine, rounds included, and a
    shape seen before reuses the very same state tensors."""
    target = build_target("llama", seed=5)
    drafter = build_drafter(target, typ, True) if typ else None
    engine = SpeculativeEngine(target, drafter, max_len=96)
    calls = [(_prompts(0, (13, 11)), 30, None), (_prompts(1, (2, 5)), 30, None), (_prompts(2, (4, 1, 6)), 30, None),
             (_prompts(3, (3, 9)), 17, None), (_prompts(4, (6, 2)), 30, [7, 8])]
    for prompts, max_new, eos in calls:
        fresh = SpeculativeEngine(target, drafter, max_len=96)
        ref = fresh.generate(prompts, max_new_tokens=max_new, eos_token_id=eos)
        assert engine.generate(prompts, max_new_tokens=max_new, eos_token_id=eos) == ref
        assert engine.rounds == fresh.rounds
    k = drafter.config.num_proposals if drafter else 0
    assert set(engine._caches) == {2, 3}
    w = 2 * k + 1  # uniforms per row and round (linear rounds; a sampled tree round may need more)
    assert set(engine._states) == {(2, k, 30 + k + 1, 0, w), (3, k, 30 + k + 1, 0, w), (2, k, 17 + k + 1, 0, w),
                                   (2, k, 30 + k + 1, 2, w)}
    st = engine._states[(2, k, 31 + k, 0, w)]
    out, cache_k = st.out, st.cache.k[0]
    engine.generate(_prompts(5, (8, 3)), max_new_tokens=30)
    assert engine._states[(2, k, 31 + k, 0, w)].out is out and engine._caches[2][0].k[0] is cache_k


TREE = [(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]


@pytest.mark.parametrize("mode", ["ar", "pld", "linear", "tree_lookup", "linear_lookup"])
@pytest.mark.parametrize("do_sample", [False, True])
def test_run_ahead_equals_the_blocking_loop_with_one_round_more(mode, do_sample):
    """`run_ahead` launches the next round before reading the last one's flags, so after the last row finishes one
    more round runs: it must change nothing (tokens, round logs, lookup logs, the sampler's draws of the rounds that
    count). Rows finish at different rounds here (an EOS list and prompts of other lengths), so the extra round also
    passes over rows that finished earlier. Where the next round depends on the host's read (the drafter-skipping
    lookup variant), the blocking loop runs: no extra round."""
    target = build_target("llama", seed=5)
    drafter = None if mode in ("ar", "pld") else build_drafter(target, "dflash", True)
    prompts = _prompts(3, (4, 11, 2))
    kw = dict(max_new_tokens=27, do_sample=do_sample, temperature=0.8, seed=3, eos_token_id=list(range(3, 99, 8)),
              prompt_lookup_num_tokens=3 if mode in ("pld", "tree_lookup", "linear_lookup") else None,
              tree=TREE if mode.startswith("tree") else None)
    blocking = SpeculativeEngine(target, drafter, max_len=96, run_ahead=False)
    ref = blocking.generate(prompts, **kw)
    engine = SpeculativeEngine(target, drafter, max_len=96)
    assert engine.generate(prompts, **kw) == ref
    assert engine.rounds == blocking.rounds and engine.lookup_rounds == blocking.lookup_rounds
    assert len({len(r) for r in blocking.rounds}) > 1, "rows should finish at different rounds"
    assert blocking.last_launched >= max(len(r) for r in blocking.rounds) > 0
    assert engine.last_launched == blocking.last_launched + (mode != "linear_lookup")
    # continuous batching (3 prompts through 2 rows: one refill): the refill lands behind the round queued ahead,
    # which passes over the finished row, so the refilled prompt starts one round later than in the blocking loop
    queued = engine.generate(prompts, batch_size=2, **kw)
    blocked = blocking.generate(prompts, batch_size=2, **kw)
    if not do_sample:  # sampled: the refilled row takes the next round's uniforms, another (equally valid) draw
        assert queued == blocked and engine.rounds == blocking.rounds
        assert engine.lookup_rounds == blocking.lookup_rounds
        ahead = mode != "linear_lookup"  # (its drafter-skipping variant keeps the blocking loop)
        # one round after the last row finished, and at most one more for the late start of the refilled prompt
        assert blocking.last_launched + ahead <= engine.last_launched <= blocking.last_launched + 2 * ahead


def test_cuda_graphs_on_cpu_runs_eagerly_without_warning():
    target = build_target("llama")
    drafter = build_drafter(target, "dflash", True)
    prompts = _prompts(0, (4, 7))
    ref = SpeculativeEngine(target, drafter, max_len=64)
    expected = ref.generate(prompts, max_new_tokens=12)
    assert ref.last_mode == "eager"
    engine = SpeculativeEngine(target, drafter, max_len=64, cuda_graphs=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert engine.generate(prompts, max_new_tokens=12) == expected
    assert engine.last_mode == "eager (no CUDA)"


class _EagerGraph:
    """Stands in for a CUDAGraph on CPU: replay() runs the round function it was 'captured' from."""

    def __init__(self, fn):
        self.replay = fn


def _fake_capture(captured):
    def capture(round_fn, tensors, warmup=3, stream=None):
        before = [t.clone() for t in tensors]
        with restored(tensors):  # the real warm-up: decode on the live state, then restore it
            for _ in range(warmup):
                round_fn()
            assert any(not torch.equal(t, s) for t, s in zip(tensors, before))
        assert all(torch.equal(t, s) for t, s in zip(tensors, before)), "warm-up left a trace"
        captured.append(tensors)
        return _EagerGraph(round_fn)

    return capture


@pytest.mark.parametrize("typ", ["dflash", None])
def test_graph_path_plumbing_with_eager_stand_in(monkeypatch, typ):
    """The cuda_graphs control flow on CPU: warm-up rounds on the live state leave no trace (restore), one capture
    per shape serves later prompts of other lengths, the replay loop gives the eager tokens and rounds, greedy and
    sampled (one more capture, and the same seed draws the eager tokens: the uniforms are drawn outside the round).
    The prompts are prefilled through the row prefill's stand-in graphs: one per width bucket, all prompts here in
    one. Each call starts through a captured start too (`SpeculativeEngine._start`), once per state."""
    monkeypatch.setattr(engine_mod, "_is_cuda", lambda dev: True)
    captured, prefills = [], []
    monkeypatch.setattr(capture_mod, "capture_round", _fake_capture(captured))
    monkeypatch.setattr(refill_mod, "capture_round", _fake_capture(prefills))
    target = build_target("llama", seed=5)
    drafter = build_drafter(target, typ, True) if typ else None
    engine = SpeculativeEngine(target, drafter, max_len=96, cuda_graphs=True)
    for seed, lengths in ((0, (5, 12)), (1, (3, 2)), (2, (9, 4))):
        prompts = _prompts(seed, lengths)
        fresh = SpeculativeEngine(target, drafter, max_len=96)
        assert engine.generate(prompts, max_new_tokens=25) == fresh.generate(prompts, max_new_tokens=25)
        assert engine.rounds == fresh.rounds and engine.last_mode == "cuda_graph"
    assert len(captured) == 2  # the round and the call's start (`SpeculativeEngine._start`)
    for seed, lengths in ((3, (4, 11)), (4, (7, 2))):
        prompts, fresh = _prompts(seed, lengths), SpeculativeEngine(target, drafter, max_len=96)
        kw = dict(max_new_tokens=25, do_sample=True, temperature=0.9, seed=seed)
        assert engine.generate(prompts, **kw) == fresh.generate(prompts, **kw)
        assert engine.rounds == fresh.rounds and engine.last_mode == "cuda_graph"
    assert len(captured) == 3  # one greedy and one sampled round for this shape; both start the same state
    assert len(prefills) == 2  # the forward (every prompt here is in the first width bucket) and the copy-in
    # continuous batching (5 prompts through 2 rows): refilled rows restart through a captured graph of their own
    # (`DecodeState.restart`, once per state), with the eager engine's tokens and rounds, greedy and sampled; the same
    # with the next prompt's forward run ahead through the same stand-in graphs (`prefill_ahead`), and with the next
    # two in one forward (`prefill_ahead=2`: a two-slot row prefill, its own forward and copy-in graphs)
    prompts = _prompts(5, (6, 3, 8, 2, 5))
    for ahead in (False, True, 2):
        engine.prefill_ahead = ahead
        for kw in (dict(max_new_tokens=20), dict(max_new_tokens=20, do_sample=True, temperature=0.9, seed=7)):
            fresh = SpeculativeEngine(target, drafter, max_len=96, prefill_ahead=False)  # eager, plain refills
            assert engine.generate(prompts, batch_size=2, **kw) == fresh.generate(prompts, batch_size=2, **kw)
            assert engine.rounds == fresh.rounds and engine.last_mode == "cuda_graph"
    assert sum(key[0] == "restart" for key in engine._graphs if isinstance(key, tuple)) == 1
    assert len(prefills) == 4  # the batch-2 row prefill of the calls above serves the one-slot refills (no new
    # capture); the two-slot one captured its forward and copy-in once for its calls


def test_row_prefill_is_compiled_with_the_rounds(monkeypatch):
    """With compile, the row prefill runs compiled as the rounds do (a captured eager prefill cost four plain decoding
    steps on the H200, `refill.py`), whole (no graph break), with the eager engine's tokens and rounds; without
    compile it stays the plain method. (One compile for both widths: `test_row_prefill_compile.py`.)"""
    fills = []
    compiled = SpeculativeEngine._compiled

    def spy(self, fn, dynamic=False):  # records the widths the compiled prefill is called with
        out = compiled(self, fn, dynamic)
        if getattr(fn, "__name__", "") != "_forward":
            return out

        def run(tokens, logits):
            fills.append(tokens.shape[1])
            return out(tokens, logits)
        return run

    monkeypatch.setattr(SpeculativeEngine, "_compiled", spy)
    target = build_target("llama", seed=5)
    drafter = build_drafter(target, "dflash", True)
    prompts = _prompts(2, (5, 140))  # two width buckets: 128 and 256
    kw = dict(max_new_tokens=10, prompt_lookup_num_tokens=4)
    ref = SpeculativeEngine(target, drafter, max_len=256)
    expected = ref.generate(prompts, **kw), ref.rounds
    engine = SpeculativeEngine(target, drafter, max_len=256, compile="aot_eager")
    engine.row_prefill = True
    torch._dynamo.utils.counters.clear()
    assert (engine.generate(prompts, **kw), engine.rounds) == expected
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert sorted(set(fills)) == [128, 256]
    plain = SpeculativeEngine(target, drafter, max_len=256)
    plain.row_prefill = True
    assert (plain.generate(prompts, **kw), plain.rounds) == expected
    (prefill,) = plain._prefills.values()
    assert prefill._forward_fn == prefill._forward and prefill._copy_fn == prefill._copy_in


def test_failed_capture_falls_back_to_eager_with_one_warning(monkeypatch):
    monkeypatch.setattr(engine_mod, "_is_cuda", lambda dev: True)

    def broken(round_fn, tensors, warmup=3, stream=None):
        with restored(tensors):
            round_fn()  # a warm-up round ran before capture failed: it must leave no trace
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(capture_mod, "capture_round", broken)
    monkeypatch.setattr(refill_mod, "capture_round", broken)  # the row prefill captures too (one graph per width)
    target = build_target("llama")
    drafter = build_drafter(target, "markov", True)
    engine = SpeculativeEngine(target, drafter, max_len=256, cuda_graphs=True)
    ref = SpeculativeEngine(target, drafter, max_len=256)
    prompts = _prompts(0, (4, 140))  # two width buckets: the prefill stops trying after its first failure
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert engine.generate(prompts, max_new_tokens=20) == ref.generate(prompts, max_new_tokens=20)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert sum("row prefill" in m and "not permitted" in m for m in messages) == 1, messages
    assert sum(m.startswith("CUDA-graph capture failed for batch") and "not permitted" in m for m in messages) == 1
    assert sum(m.startswith("CUDA-graph capture of a call's start failed") and "not permitted" in m
               for m in messages) == 1
    assert engine.last_mode == "eager (capture failed: RuntimeError: operation not permitted when stream is capturing)"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the failure is remembered per shape: no second attempt, no second warning
        assert engine.generate(prompts[::-1], max_new_tokens=20) == ref.generate(prompts[::-1], max_new_tokens=20)
    assert engine.last_mode.startswith("eager (capture failed")


def test_engine_attention_keeps_gqa_in_sdpa_and_restores_the_targets_choice():
    """While the engine decodes, an "sdpa" target attends through `gqa_sdpa_attention` (SDPA with grouped K/V heads,
    no repeated copies), with plain greedy decoding's tokens; afterwards, also after an error inside the call, the
    target is on "sdpa" again. An "eager" target is switched too (eager attention adds a boolean mask as 0/1) and
    restored; a flash-attention target is refused by name."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hf_carryover.engine import attention as attn

    # the function itself: transformers' SDPA result for a bool mask with grouped heads, and its fallback otherwise
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, n, 8, generator=g, dtype=torch.float64) for h, n in ((4, 5), (2, 11), (2, 11)))
    mask = torch.rand(2, 1, 5, 11, generator=g) < 0.7
    mask[..., 0] = True  # every query row sees a key
    module = type("Attn", (), {"num_key_value_groups": 2, "training": False})()
    ours, _ = attn.gqa_sdpa_attention(module, q, k, v, mask, scaling=0.3)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    assert ours.shape == ref.shape == (2, 5, 4, 8) and torch.allclose(ours, ref, atol=1e-12)
    # a call with softcap is left to transformers' function as it stands in the installed version (5.24 refuses
    # softcap, 5.17 ignores it): the engine then attends exactly as the target does outside it
    handed = []

    def handed_to_transformers(*a, **kw):
        handed.append(kw.get("softcap"))
        return sdpa_attention_forward(*a, **kw)

    def outcome(fn):
        try:
            return fn(module, q, k, v, mask, scaling=0.3, softcap=30.0)[0]
        except ValueError as err:
            return str(err)

    expected = outcome(sdpa_attention_forward)
    with patch.object(attn, "sdpa_attention_forward", handed_to_transformers):
        got = outcome(attn.gqa_sdpa_attention)
    assert handed == [30.0]
    assert got == expected if isinstance(expected, str) else torch.equal(got, expected)

    target = build_target("llama", seed=5)
    assert target.config._attn_implementation == "sdpa"
    drafter = build_drafter(target, "dflash", True)
    prompts = [[5, 9, 3, 7], [11, 4]]
    ref_tokens = _greedy_refs(target, prompts, 12)
    seen = []
    real = AttentionInterface._global_mapping[attn.ATTENTION]

    def spy(module, *a, **kw):
        seen.append(module.config._attn_implementation)
        return real(module, *a, **kw)

    AttentionInterface._global_mapping[attn.ATTENTION] = spy
    try:
        eng = SpeculativeEngine(target, drafter, max_len=64)
        assert eng.generate(prompts, max_new_tokens=12) == ref_tokens
        assert seen and set(seen) == {attn.ATTENTION}
        assert target.config._attn_implementation == "sdpa"
        with pytest.raises(ValueError, match="max_len"):  # raised inside the call: the target is restored
            eng.generate([list(range(1, 60))], max_new_tokens=12)
        assert target.config._attn_implementation == "sdpa"

        eager = build_target("llama", seed=5)
        eager.config._attn_implementation = "eager"
        n = len(seen)
        assert SpeculativeEngine(eager, None, max_len=64).generate(prompts, max_new_tokens=12) == _greedy_refs(
            eager, prompts, 12)
        assert len(seen) > n and eager.config._attn_implementation == "eager"  # eager would add the bool mask
        eager.config._attn_implementation = "flash_attention_2"
        with pytest.raises(ValueError, match="attn_implementation='flash_attention_2'"):
            SpeculativeEngine(eager, None, max_len=64)
    finally:
        AttentionInterface._global_mapping[attn.ATTENTION] = real


def test_frozen_compiled_round_merges_projections_and_equals_eager():
    """compile_options={"freezing": True} compiles the weights in as constants, and inductor then merges the q/k/v
    projections and the gate/up projections that read the same input: 4 GEMMs per layer instead of 7 (the merge needs
    "cpp.enable_concat_linear" on CPU; inductor's check asks for it on CPU only, not run on CUDA here). Tokens and
    rounds stay the eager engine's in fp32. The generated code is read back (`run_and_get_code`), with inductor's
    graph cache off so that a cached compile cannot hide it. With the weights left unpacked, as on CUDA, the engine's
    `FuseSharedInputMatmuls` pass does the merge (`fuse_projections.py`). Two-layer targets: the merge is per layer
    (the counts below scale with the depth), and each of the two uncached inductor compiles costs ~40 % less."""
    from torch._inductor.utils import run_and_get_code

    target = build_target("llama", seed=5, num_layers=2)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 90, (n,), generator=g).tolist() for n in (4, 9)]
    eager = SpeculativeEngine(target, None, max_len=96)
    ref = eager.generate(prompts, max_new_tokens=20)
    fast = SpeculativeEngine(target, None, max_len=96, compile=True, compile_options={
        "freezing": True, "cpp.enable_concat_linear": True, "fx_graph_cache": False})
    out, codes = run_and_get_code(lambda: fast.generate(prompts, max_new_tokens=20))
    assert out == ref and fast.rounds == eager.rounds and fast.last_mode == "eager +compile"
    gemm = re.compile(r"= (?:torch\.ops\.mkl\._mkl_linear\.default|extern_kernels\.(?:mm|addmm)|"
                      r"torch\.ops\.mkldnn\._linear_pointwise\.default)\(")
    layers = target.config.num_hidden_layers
    assert sum(len(gemm.findall(c)) for c in codes) == 4 * layers + 1  # + the LM head; unmerged: 7 per layer
    # GEMMs as CUDA sees them: in float64 inductor leaves the weights unpacked, and without the CPU concat option its
    # own pattern merges nothing, so the merges are the engine's pass's (`fuse_projections.py`): q with the narrower
    # grouped-query k/v, and gate/up. A second target of the same shape: a frozen round must not serve it (dynamo
    # reused the first engine's compiled round, weights and all, before engines with options had backends of their own)
    other = build_target("llama", seed=6, num_layers=2).double()
    ref64 = SpeculativeEngine(other, None, max_len=96).generate(prompts, max_new_tokens=20)
    cuda_like = SpeculativeEngine(other, None, max_len=96, compile=True, compile_options={
        "freezing": True, "fx_graph_cache": False})
    out, codes = run_and_get_code(lambda: cuda_like.generate(prompts, max_new_tokens=20))
    assert out == ref64 != ref
    assert cuda_like.fused_projections.fused == 3 * layers  # q/k/v: 3 -> 1, gate/up: 2 -> 1
    assert cuda_like.fused_projections.graphs >= 1  # (0 would make benchmark rows report fused_gemms as unknown)
    assert sum(c.count("extern_kernels.mm(") for c in codes) == 4 * layers + 1
    off = SpeculativeEngine(target, None, max_len=96, compile=True, compile_options={
        "freezing": True, "post_grad_custom_pre_pass": None})  # the slot named: the engine adds no pass
    assert off.fused_projections is None and cuda_like.compile_options == {"freezing": True, "fx_graph_cache": False}
    for bad in ({"compile": False}, {"compile": "aot_eager"}):  # inductor options without inductor: refused
        with pytest.raises(ValueError, match="inductor options"):
            SpeculativeEngine(target, None, max_len=96, compile_options={"freezing": True}, **bad)
    with pytest.raises(ValueError, match="freezin does not exist"):  # a misspelt option, named when the engine is built
        SpeculativeEngine(target, None, max_len=96, compile=True, compile_options={"freezin": True})


@pytest.mark.parametrize("typ,backend", [("dflash", "inductor"), (None, "aot_eager")])
def test_compiled_round_equals_eager(typ, backend, monkeypatch):
    """compile=True runs the same round through torch.compile (inductor's C++ backend here): same tokens, same
    rounds as the eager engine in fp32, and the mode says so. Sampled rounds are compiled too, and with
    the same seed they draw the eager round's tokens (the uniforms come from the call's Generator either way).
    This is the suite's one inductor compile (about a minute on CPU); the other compile tests trace the same way
    through "aot_eager" (graph breaks, guards, plumbing) without inductor's code generation. With inductor the
    prompts are prefilled row by row, at two widths through the one compile of a dynamic width (`refill.py`)."""
    import hf_carryover.engine.refill as refill

    monkeypatch.setattr(refill, "WIDTH_ALIGN", 8)  # prompts of 4 and 9 tokens: widths 8 and 16
    target = build_target("llama", seed=5)
    drafter = build_drafter(target, typ, True) if typ else None
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 90, (n,), generator=g).tolist() for n in (4, 9)]
    eager = SpeculativeEngine(target, drafter, max_len=96)
    fast = SpeculativeEngine(target, drafter, max_len=96, compile=True if backend == "inductor" else backend)
    fast.row_prefill = backend == "inductor"
    ref = eager.generate(prompts, max_new_tokens=20)
    if backend == "inductor":  # and no compiled code copies a whole cache: the row prefill's forward and copy-in
        from test_engine_tree import _whole_cache_buffers  # and the round write every cache in place
        from torch._inductor.utils import run_and_get_code

        out, codes = run_and_get_code(lambda: fast.generate(prompts, max_new_tokens=20))
        (cache, dcache), = fast._caches.values()
        assert len(codes) == 3 and _whole_cache_buffers(codes, cache.k + dcache.keys) == 0
    else:
        out = fast.generate(prompts, max_new_tokens=20)
    assert out == ref and fast.rounds == eager.rounds
    if fast.row_prefill:
        prefill = next(iter(fast._prefills.values()))
        assert sorted(prefill.tokens) == [8, 16] and prefill.dynamic_width  # no fallback to per-width compiles
    assert fast.last_mode == "eager +compile"
    sampled = eager.generate(prompts, max_new_tokens=20, do_sample=True, temperature=0.8, seed=3)
    counters = torch._dynamo.utils.counters
    counters.clear()
    assert fast.generate(prompts, max_new_tokens=20, do_sample=True, temperature=0.8, seed=3) == sampled
    assert fast.rounds == eager.rounds and fast.last_mode == "eager +compile"
    # no Generator reaches the sampled round (a Generator argument broke it into ~8 pieces); the only breaks are the
    # draws' running sums, left to ATen's fixed-order scans (`running_mass`): one for a DFlash drafter's proposals,
    # one for the correction/bonus token
    breaks = counters["graph_break"]
    assert breaks and all("running_mass" in reason for reason in breaks), dict(breaks)
    assert sampled != ref  # the sampled run is not the greedy one in disguise


def test_gemv_rows_generates_one_row_gemms_as_reductions():
    """gemv_rows=1: a batch-1 plain step's frozen GEMMs (per layer q/k/v, o, gate/up, down; and the LM head) become
    inductor reductions instead of `extern_kernels.mm` calls, with the eager engine's tokens (float64: weights left
    unpacked, as on CUDA, and the products summed in float64), also with the weight first in each product (what
    inductor's `triton.enable_pdl` asks of the rewrite). With gemv_fusion=True (and "norms") the RMSNorm
    before q/k/v, before gate/up and before the LM head is computed inside its reduction (2 a layer + 1); without it
    they stay outside. Two rows keep their GEMMs (M=2 > 1). Without freezing, or
    as anything but a whole number of rows, the option is refused by name. Every compiled engine here also runs the
    frozen pass's RoPE rewrite (`rotate_half.py`: q and k of each layer), so the tokens check it too."""
    from torch._inductor.utils import run_and_get_code

    target = build_target("llama", seed=7, num_layers=2).double()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 90, (n,), generator=g).tolist() for n in (5, 8)]
    layers = target.config.num_hidden_layers
    for rows, rewritten in ((prompts[:1], 4 * layers + 1), (prompts, 0)):
        ref = SpeculativeEngine(target, None, max_len=96).generate(rows, max_new_tokens=16)
        mms = []
        for gemv_rows, fusion, pdl in ((0, True, False), (1, False, False), (1, True, False), (1, "norms", False),
                                       (1, False, True)):
            options = {"freezing": True, "fx_graph_cache": False, **({"triton.enable_pdl": True} if pdl else {})}
            fast = SpeculativeEngine(target, None, max_len=96, compile=True, gemv_rows=gemv_rows, gemv_fusion=fusion,
                                     compile_options=options)
            out, codes = run_and_get_code(lambda: fast.generate(rows, max_new_tokens=16))
            assert out == ref
            mms.append(sum(c.count("extern_kernels.mm(") for c in codes))  # the round's and the row prefill's
            # every graph's RoPE rotate_half (q and k, each layer) is indexing, not a cat (`rotate_half.py`)
            assert fast.fused_projections.rotations == 2 * layers * fast.fused_projections.graphs > 0
            if gemv_rows:
                record = fast.fused_projections.record()
                assert record["gemvs"] == rewritten and record["gemv_fusion"] == fusion
                assert record["gemv_weights_first"] == pdl  # the weight first in each product: the same tokens
                assert record["gemv_norms"] == (2 * layers + 1 if fusion and rewritten else 0)
        assert mms[0] - mms[1] == rewritten and mms[1] == mms[2] == mms[3] == mms[4]  # the prefill keeps its GEMMs
    with pytest.raises(ValueError, match="gemv_rows=1 .*'freezing'"):
        SpeculativeEngine(target, None, max_len=96, compile=True, gemv_rows=1)
    # "auto" (the default): on only where timed, a CUDA target of hidden size <= 1024 with frozen weights and the
    # pass's slot free; this CPU target stays off, with or without freezing, and so is not refused
    for options in ({}, {"freezing": True}):
        assert SpeculativeEngine(target, None, max_len=96, compile=True, compile_options=options).gemv_rows == 0
    frozen, cuda = {"freezing": True}, torch.device("cuda", 0)  # (where "auto" turns on: the test below)
    wide = type(target.config)(**{**target.config.to_dict(), "hidden_size": 2560})  # a 4B target's width
    assert auto_gemv_rows(True, cuda, frozen, wide) == 0
    with pytest.raises(ValueError, match="gemv_rows='on': 'auto', or a number of rows"):
        SpeculativeEngine(target, None, max_len=96, compile=True, gemv_rows="on", compile_options=frozen)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="gemv_rows=.*: .auto., or a number of rows"):
            SpeculativeEngine(target, None, max_len=96, compile=True, gemv_rows=bad,
                              compile_options={"freezing": True})
    with pytest.raises(ValueError, match="gemv_fusion=1: True, False or 'norms'"):
        SpeculativeEngine(target, None, max_len=96, compile=True, gemv_rows=1, gemv_fusion=1,
                          compile_options={"freezing": True})


def test_fused_linear_rows_auto_only_where_timed(monkeypatch):
    """fused_linear_rows="auto" (the default) is 32 only where it was timed faster: a CUDA target with Triton, frozen
    weights and the pass's slot free, projections of at most 2048 inputs (the reference target: 576 and 1536); the
    same compile conditions as gemv_rows="auto" (1 there). A CPU target resolves to 0 and so is not refused for
    lacking a GPU; other values are refused by name."""
    target = build_target("llama")
    frozen, cuda = {"freezing": True}, torch.device("cuda", 0)
    for options in ({}, frozen):
        engine = SpeculativeEngine(target, None, max_len=96, compile=True, compile_options=options)
        assert engine.fused_linear_rows == 0
    assert engine.fused_projections.fused_rows == 0  # the frozen engine's own pass runs, folding nothing
    assert SpeculativeEngine(target, None, max_len=96).fused_linear_rows == 0  # not compiled
    monkeypatch.setattr(capture_mod, "triton_available", lambda device: None)  # as on a GPU with Triton
    for auto, on in ((auto_gemv_rows, 1), (auto_fused_linear_rows, 32)):  # on under the same conditions
        assert auto(True, cuda, frozen, target.config) == on
        assert auto(True, "cuda", frozen, target.config) == on
        assert auto(False, cuda, frozen, target.config) == 0  # no compile
        assert auto(True, cuda, {}, target.config) == 0  # weights not frozen
        assert auto(True, cuda, {**frozen, "post_grad_custom_pre_pass": None}, target.config) == 0
        assert auto(True, "cpu", frozen, target.config) == 0
    as_config = lambda **kw: type(target.config)(**{**target.config.to_dict(), **kw})  # noqa: E731
    assert auto_fused_linear_rows(True, cuda, frozen, as_config(hidden_size=576, intermediate_size=1536)) == 32
    assert auto_fused_linear_rows(True, cuda, frozen, as_config(hidden_size=2560, intermediate_size=9728)) == 0
    assert auto_fused_linear_rows(True, cuda, frozen, as_config(hidden_size=1024, intermediate_size=4096)) == 0
    monkeypatch.setattr(capture_mod, "triton_available", lambda device: "Triton is not installed")
    assert auto_fused_linear_rows(True, cuda, frozen, target.config) == 0  # no Triton: off, not refused
    for bad in ("on", -1, 1.5, True):
        with pytest.raises(ValueError, match="fused_linear_rows=.*: 'auto', or a number of rows"):
            SpeculativeEngine(target, None, max_len=96, compile=True, fused_linear_rows=bad, compile_options=frozen)


def test_rotate_half_rewrite_gives_the_same_bits():
    """The frozen pass's RoPE rewrite (`rotate_half.py`) writes transformers' `rotate_half` cat as indexing: compiled
    with it, RoPE gives the bits it gives compiled without it, in float32 (there also eager's) and bfloat16 (inductor
    rounds bf16 products only where a kernel stores, so eager differs either way), and the cat is gone."""
    import torch._inductor.config as inductor_config
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from hf_carryover.engine.rotate_half import rotate_half_without_cat

    seen = []

    def rewrite(graph):
        seen.append(rotate_half_without_cat(graph))
        seen.append(sum(n.target is torch.ops.aten.cat.default for n in graph.nodes))

    def count_cats(graph):
        seen.append(sum(n.target is torch.ops.aten.cat.default for n in graph.nodes))

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        q, k = (torch.randn(2, 3, 5, 64, generator=g).to(dtype) for _ in range(2))
        cos, sin = (torch.randn(2, 5, 64, generator=g).to(dtype) for _ in range(2))
        outs = []
        for graph_pass in (count_cats, rewrite):
            torch._dynamo.reset()
            seen.clear()
            with inductor_config.patch({"post_grad_custom_pre_pass": graph_pass, "fx_graph_cache": False}):
                outs.append(torch.compile(apply_rotary_pos_emb, fullgraph=True)(q, k, cos, sin))
            assert seen == ([2] if graph_pass is count_cats else [2, 0])  # q's and k's rotations; none left after
        for a, b in zip(*outs):
            assert torch.equal(a, b)
        if dtype == torch.float32:
            for a, b in zip(outs[1], apply_rotary_pos_emb(q, k, cos, sin)):
                assert torch.equal(a, b)


def test_compiled_target_features_are_the_drafters_cat_without_a_cat():
    """`SpeculativeEngine.target_features`: compiled (the engine's rounds and row prefill), the tapped layers are
    assigned into slices of one buffer, with no `cat` left in the graph inductor lowers; eager, the drafter's own
    `cat`. Both give `Drafter.target_features`' bits, in float32 and bfloat16, with the tapped layers out of order."""
    target = build_target("llama", num_layers=5)
    drafter = build_drafter(target, "dflash", True, target_layer_ids=[2, 0, 3])
    engine = SpeculativeEngine(target, drafter, max_len=32)
    g = torch.Generator().manual_seed(0)
    cats = []

    def count_cats(graph):
        cats.append(sum(n.target is torch.ops.aten.cat.default for n in graph.nodes))

    import torch._inductor.config as inductor_config

    for dtype in (torch.float32, torch.bfloat16):
        hidden = tuple(torch.randn(2, 5, target.config.hidden_size, generator=g).to(dtype) for _ in range(6))
        want = drafter.target_features(hidden)
        assert want.shape == (2, 5, 3 * target.config.hidden_size)
        assert torch.equal(engine.target_features(hidden), want)
        torch._dynamo.reset()
        with inductor_config.patch({"post_grad_custom_pre_pass": count_cats, "fx_graph_cache": False}):
            got = torch.compile(lambda *h: engine.target_features(h), fullgraph=True)(*hidden)
        assert got.dtype == dtype and torch.equal(got, want)
    assert cats == [0, 0]
