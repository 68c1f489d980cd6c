"""The engine's Triton attention kernel (`hf_carryover/engine/triton_attention.py`), checked on CPU in Triton's
interpreter: the kernel against float64 SDPA on causal, tree-shaped, broadcast and empty masks, and engines with
`attention="triton"` against plain greedy decoding (linear, tree + lookup, compiled rounds), sampled rounds against
the SDPA engine's.

The interpreter must be switched on before Triton is imported, and this process may have imported Triton already,
so the checks run in a fresh interpreter (`_run`). They are slow (each kernel call is interpreted in numpy), so the
models are tiny."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import build_drafter, build_target

pytest.importorskip("triton")
TESTS = Path(__file__).resolve().parent


def _run(body: str) -> dict:
    """Run `body` under TRITON_INTERPRET=1 in a new Python; it prints one JSON line last, returned here."""
    script = "import json, torch, sys\nsys.path.insert(0, %r)\ntorch.set_num_threads(1)\n" % str(TESTS)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", script + textwrap.dedent(body)], env=env, capture_output=True,
                         text=True, timeout=900, cwd=TESTS.parent)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_kernel_equals_sdpa_on_every_mask_the_engine_makes():
    out = _run("""
        import itertools

        import torch.nn.functional as F
        from hf_carryover.engine import triton_attention
        from hf_carryover.engine.triton_attention import check_inputs, masked_gqa_attention, split_plan

        g = torch.Generator().manual_seed(0)
        errs = {}

        def case(name, b, heads, kvh, q, keys, mask, dtype=torch.float32, modes=("scan", "skip"), blocks=(16, 64),
                 splits=(0,), block_ms=(0,), ends=(None,)):
            Q = torch.randn(b, heads, q, 64, generator=g).to(dtype)
            K = torch.randn(b, kvh, keys, 64, generator=g).to(dtype)
            V = torch.randn(b, kvh, keys, 64, generator=g).to(dtype)
            assert check_inputs(Q, K, V, mask) is None
            full = mask.expand(b, 1, q, keys)
            ref = F.scaled_dot_product_attention(Q.double(), K.double(), V.double(), attn_mask=full,
                                                 enable_gqa=True).transpose(1, 2)  # [b, q, heads, d]
            ref = torch.nan_to_num(ref, nan=0.0)  # rows that see nothing: SDPA's NaN, the kernel's zeros
            # key_end: each batch row's last seen key + 1 (exact), past the cache (loose: clamped by the kernel) or
            # 64 keys short (the kernel walks whole key blocks up to the end, so a block of seen keys is dropped and
            # the result must differ: it takes the caller's word)
            seen = full[:, 0].any(1)  # [b, keys]
            last = torch.where(seen, torch.arange(keys), -1).amax(1) + 1  # [b]
            given = {None: None, "exact": last, "loose": last + keys, "short": last - 64}
            for mode, bn, sp, bm, e in itertools.product(modes, blocks, splits, block_ms, ends):
                o = masked_gqa_attention(Q, K, V, mask, 64 ** -0.5, mode, bn, 4, sp, block_m=bm, key_end=given[e])
                assert o.shape == (b, q, heads, 64) and o.dtype == dtype
                errs[f"{name}/{mode}{bn}" + (f"s{sp}" if sp else "") + (f"m{bm}" if bm else "")
                     + (f"/{e}" if e else "")] = (o.double() - ref).abs().max().item()

        keys = torch.arange(200)
        # a linear round: query rows at positions 50.. / 120.. see keys at positions <= their own (200 keys: not a
        # multiple of the 64-key blocks)
        pos = torch.tensor([[50 + i for i in range(5)], [120 + i for i in range(5)]])
        # split over keys (32 or 64 keys a part: 7 or 4 parts): rows at 50.. use 2 parts, rows at 120.. 4 or 2
        case("causal", 2, 9, 3, 5, 200, keys[None, None, None, :] <= pos[:, None, :, None], splits=(0, 32),
             modes=("scan", "skip", "dense"))
        # a tree round of 47 rows (141 rows of three heads: three row blocks of 64, or nine of 16): committed keys and
        # random ancestors
        anchor = torch.tensor([30, 90])
        anc = torch.rand(2, 47, 47, generator=g) < 0.3
        anc = anc.tril() | torch.eye(47, dtype=torch.bool)
        rel = keys[None, :] - anchor[:, None]
        inside = (rel >= 0) & (rel < 47)
        cols = anc.gather(2, rel.clamp(0, 46)[:, None, :].expand(-1, 47, -1))
        case("tree", 2, 9, 3, 47, 200, ((rel < 0)[:, None, :] | (inside[:, None, :] & cols))[:, None],
             modes=("scan", "dense"), splits=(0, 32), block_ms=(0, 16))
        # each batch row's end of the keys in use given (`key_end`) instead of scanned: exact, loose and 64 keys short
        case("causal_end", 2, 9, 3, 5, 200, keys[None, None, None, :] <= pos[:, None, :, None], modes=("scan", "dense"),
             blocks=(64,), splits=(0, 32), ends=("exact", "loose", "short"))
        case("tree_end", 2, 9, 3, 47, 200, ((rel < 0)[:, None, :] | (inside[:, None, :] & cols))[:, None],
             modes=("dense",), blocks=(16,), splits=(32,), block_ms=(16,), ends=("exact", "short"))
        # one mask for the whole batch (stride 0), one head per K/V head, and a row that sees no key at all
        m = keys[None, None, None, :] < torch.tensor([0, 3, 64, 65])[None, None, :, None]
        case("broadcast_empty_row", 3, 4, 4, 4, 200, m, splits=(0, 32))
        # half precision: the kernel rounds its probabilities to the input dtype before the value product. fp16
        # stands in for the H200's bf16, which Triton's interpreter multiplies wrongly (3.6 and 3.9: a bf16 tl.dot
        # of two 16 x 16 tiles is off by ~1e10); `trainer/gpu_attention_bench.py` checks bf16 on the GPU
        case("fp16", 2, 9, 3, 5, 200, keys[None, None, None, :] <= pos[:, None, :, None], dtype=torch.float16,
             blocks=(64,))
        Q, K = torch.zeros(1, 9, 2, 64), torch.zeros(1, 3, 64, 64)
        refused = [check_inputs(Q, K, K, torch.zeros(1, 1, 2, 64)),  # additive mask
                   check_inputs(torch.zeros(1, 9, 2, 8), torch.zeros(1, 3, 64, 8), torch.zeros(1, 3, 64, 8),
                                torch.ones(1, 1, 2, 64, dtype=torch.bool)),  # head dim 8
                   check_inputs(Q, K, K, torch.ones(1, 1, 2, 64, dtype=torch.bool), mode="other"),
                   check_inputs(Q, K, K, torch.ones(1, 1, 2, 64, dtype=torch.bool), block_n=48),
                   triton_attention.check_settings("dense", 64, "attention_", block_m=24)]
        # the last part to finish resets its arrival counter: all zero again for the next call
        counters = sum(int(c.abs().sum()) for c in triton_attention._COUNTERS.values())
        plans = [split_plan(200, 16, 32), split_plan(200, 64, 32), split_plan(200, 16, 0), split_plan(200, 16, 400),
                 split_plan(4096, 16, 32)]
        print(json.dumps({"errs": errs, "refused": refused, "counters": counters, "plans": plans}))
    """)
    errs = out["errs"]
    assert len(errs) == 52
    for name, err in errs.items():
        if name.endswith("/short"):  # seen keys dropped: the kernel read the given end, not the mask's
            assert err > 1e-2, (name, err)
        else:
            assert err < (2e-3 if name.startswith("fp16") else 2e-6), (name, err)
    assert errs["broadcast_empty_row/scan16"] < 2e-6  # the empty row's zeros are part of this comparison
    refused = out["refused"]
    assert "boolean mask" in refused[0] and "head_dim=8" in refused[1]
    assert "mode='other'" in refused[2] and "block_n=48" in refused[3] and "attention_block_m=24" in refused[4]
    assert out["counters"] == 0
    # (keys a part, parts): whole key blocks, at most MAX_SPLITS (16) parts; 0 or a part as long as the cache: one
    assert out["plans"] == [[32, 7], [64, 4], [200, 1], [200, 1], [256, 16]]


def test_key_end_is_each_forwards_last_seen_key_plus_one():
    """`attention_key_end`'s plumbing on CPU (the attention is SDPA here, which ignores the keyword): every target
    forward, the rounds' (tree + lookup) and the row prefills' of continuous batching, hands over each row's end of
    the keys in use, and it is exactly one past the last key its mask lets any query row see (a smaller one would drop
    keys, a larger one only costs time). The decoded text stays plain greedy."""
    from test_engine import _greedy_refs, _prompts
    from test_engine_tree import WIDE

    from hf_carryover.engine.attention import KEY_END
    from hf_carryover.engine.engine import SpeculativeEngine

    target = build_target("llama", num_layers=2)
    drafter = build_drafter(target, "dflash", True, target_layer_ids=[0])
    prompts = _prompts(2, (3, 9, 5))
    refs = _greedy_refs(target, prompts, 12)
    with pytest.raises(ValueError, match="attention_key_end=True hands the Triton .* attention is 'sdpa'"):
        SpeculativeEngine(target, drafter, max_len=96, attention_key_end=True)  # only with the kernel
    engine = SpeculativeEngine(target, drafter, max_len=96)
    engine.attention_key_end = True  # the plumbing alone
    calls = []

    def record(module, args, kwargs):
        mask = kwargs["attention_mask"][:, 0].any(1)  # [b, keys]: seen by some query row
        last = torch.where(mask, torch.arange(mask.shape[1]), -1).amax(1) + 1
        calls.append((kwargs.get("logits_to_keep") is not None, torch.equal(kwargs[KEY_END], last)))

    hook = target.register_forward_pre_hook(record, with_kwargs=True)
    try:
        out = engine.generate(prompts, max_new_tokens=12, tree=WIDE, tree_nodes=5, prompt_lookup_num_tokens=3,
                              batch_size=2)
    finally:
        hook.remove()
    assert out == refs
    assert all(ok for _, ok in calls), calls
    assert {refill for refill, _ in calls} == {True, False}  # row prefills and rounds both ran


def test_engine_with_triton_attention_decodes_plain_greedy_text():
    """Engines on the kernel (qwen3: head dim 16) against plain greedy decoding: linear rounds and prefills, tree +
    lookup rounds, and a compiled (aot_eager) tree round; a llama target with head dim 8 falls back to SDPA and stays
    exact; sampled rounds draw the SDPA engine's tokens (fp32). The drafter stays on SDPA but in the defaults' case
    (`test_drafter_attention_on_the_kernel_equals_sdpa` checks it on the kernel): each interpreted drafter call costs
    time, and the drafter cannot change the verified text. Two-layer targets (drafters tap layer 0): every layer
    calls the kernel alike, and each interpreted call costs about a second, so more layers would repeat the check."""
    out = _run("""
        from conftest import build_drafter, build_target
        from test_engine import _greedy_refs, _prompts
        from test_engine_tree import WIDE
        from hf_carryover.engine import attention
        from hf_carryover.engine.engine import SpeculativeEngine

        calls, ends = [], []  # each kernel call's query shape; whether it was handed its keys' end (key_end)
        real = attention.masked_gqa_attention
        attention.masked_gqa_attention = lambda *a, **kw: (calls.append(a[0].shape), ends.append(
            kw.get("key_end") is not None)) and real(*a, **kw)
        res = {}
        for arch in ("qwen3", "llama"):
            target = build_target(arch, num_layers=2)
            prompts = _prompts(0, (1, 6, 13))
            refs = _greedy_refs(target, prompts, 14)
            drafter = build_drafter(target, "dflash", True, target_layer_ids=[0])
            calls.clear()
            lin = SpeculativeEngine(target, drafter, max_len=64, attention="triton", attention_block_n=16,
                                    attention_split_n=16, drafter_attention="sdpa",  # 4 parts of 16 keys
                                    attention_key_end=True)
            ends.clear()
            res[arch + "_linear"] = lin.generate(prompts, max_new_tokens=14) == refs
            res[arch + "_calls"] = len(calls)
            res[arch + "_linear_ends"] = sum(ends)  # attention_key_end: every call (prefill, rounds)
            tree = SpeculativeEngine(target, drafter, max_len=128, attention="triton", attention_mode="skip",
                                     drafter_attention="sdpa")
            res[arch + "_tree"] = tree.generate(prompts, max_new_tokens=14, tree=WIDE, prompt_lookup_num_tokens=3,
                                                tree_nodes=5) == refs
            # the defaults ("dense", 16 row-head pairs a program, the drafter on the kernel too) with 16-key blocks in
            # parts of 32: several programs per K/V head, several parts, and blocks folded without the per-block branch
            dense = SpeculativeEngine(target, drafter, max_len=128, attention="triton", attention_block_n=16,
                                      attention_split_n=32)
            res[arch + "_tree_dense"] = dense.generate(prompts, max_new_tokens=14, tree=WIDE,
                                                       prompt_lookup_num_tokens=3, tree_nodes=5) == refs
            # the same without the keys' end (the default): the kernel scans the mask for it (same tokens)
            ends.clear()
            scan = SpeculativeEngine(target, drafter, max_len=128, attention="triton", attention_block_n=16,
                                     attention_split_n=32, drafter_attention="sdpa", attention_key_end=False)
            res[arch + "_tree_scan"] = scan.generate(prompts, max_new_tokens=14, tree=WIDE,
                                                     prompt_lookup_num_tokens=3, tree_nodes=5) == refs
            res[arch + "_tree_scan_ends"] = sum(ends)
        # plain decoding steps are one query row: attention_min_rows=2 ("auto"'s) sends them to SDPA, the prefill
        # (several rows) still runs the kernel; min_rows=1 runs the steps on the kernel too
        target = build_target("qwen3", num_layers=2)
        refs = _greedy_refs(target, prompts, 14)
        for rows in (1, 2):
            calls.clear()
            ar = SpeculativeEngine(target, None, max_len=64, attention="triton", attention_block_n=16,
                                   attention_min_rows=rows)
            res[f"ar_min_rows{rows}"] = ar.generate(prompts, max_new_tokens=14) == refs
            res[f"ar_min_rows{rows}_query_rows"] = sorted({shape[2] for shape in calls})
        attention.masked_gqa_attention = real
        drafter = build_drafter(target, "dflash", True, target_layer_ids=[0])
        prompts = _prompts(1, (4, 9))
        refs = _greedy_refs(target, prompts, 12)
        comp = SpeculativeEngine(target, drafter, max_len=128, attention="triton", compile="aot_eager",
                                 drafter_attention="sdpa")
        res["compiled_tree"] = comp.generate(prompts, max_new_tokens=12, tree=WIDE, tree_nodes=5) == refs
        kw = dict(max_new_tokens=12, do_sample=True, temperature=1.0, seed=3)
        sdpa = SpeculativeEngine(target, drafter, max_len=64).generate(prompts, **kw)
        tri = SpeculativeEngine(target, drafter, max_len=64, attention="triton", drafter_attention="sdpa")
        res["sampled"] = tri.generate(prompts, **kw) == sdpa
        res["restored"] = target.config._attn_implementation
        print(json.dumps(res))
    """)
    assert out["qwen3_linear"] and out["qwen3_tree"] and out["qwen3_tree_dense"] and out["compiled_tree"], out
    assert out["qwen3_calls"] > 0  # the kernel ran (the prefill and every round, 2 layers each)
    assert out["qwen3_linear_ends"] == out["qwen3_calls"] and out["qwen3_tree_scan"], out
    assert out["qwen3_tree_scan_ends"] == 0 == out["llama_tree_scan_ends"] and out["llama_tree_scan"], out
    assert out["llama_linear"] and out["llama_tree"] and out["llama_tree_dense"] and out["llama_calls"] == 0, out
    assert out["sampled"], out
    assert out["ar_min_rows1"] and out["ar_min_rows2"], out
    assert 1 in out["ar_min_rows1_query_rows"] and len(out["ar_min_rows1_query_rows"]) > 1, out
    assert out["ar_min_rows2_query_rows"] and min(out["ar_min_rows2_query_rows"]) > 1, out  # the prefill only
    assert out["restored"] == "sdpa"


def test_one_row_steps_take_the_kernel_only_up_to_their_keys_in_use():
    """`attention_one_row_keys=8`: plain steps of rows attending to at most 8 keys run on the kernel, the rest on SDPA.
    Three prompts (3, 20 and 2 tokens) go through one row (continuous batching), so a refill starts the count again.
    At two rows ("auto" switches calls of up to 8) a step takes the kernel only while every row still decoding is
    within the bound; a row whose output was read out no longer counts (its attention is discarded).
    The text equals plain greedy decoding. Compiled (aot_eager), each choice traces its own round: one-row kernel
    calls appear while tracing, which a round compiled once on SDPA would not show."""
    out = _run("""
        from conftest import build_target
        from test_engine import _greedy_refs, _prompts
        from hf_carryover.engine import attention
        from hf_carryover.engine.engine import SpeculativeEngine

        kernel, sdpa = [], []  # per one-row call: the keys each batch row's last query row sees
        real_kernel, real_sdpa = attention.masked_gqa_attention, attention.gqa_sdpa_attention

        def on_kernel(q, k, v, mask, *a, **kw):
            if q.shape[2] == 1:
                kernel.append(tuple(mask[:, 0, -1].sum(-1).tolist()))
            return real_kernel(q, k, v, mask, *a, **kw)

        def on_sdpa(module, q, k, v, mask, *a, **kw):
            if q.shape[2] == 1:
                sdpa.append(tuple(mask[:, 0, -1].sum(-1).tolist()))
            return real_sdpa(module, q, k, v, mask, *a, **kw)

        attention.masked_gqa_attention, attention.gqa_sdpa_attention = on_kernel, on_sdpa
        target = build_target("qwen3", num_layers=2)
        prompts = _prompts(4, (3, 20, 2))
        refs = _greedy_refs(target, prompts, 10)
        res = {}
        eng = SpeculativeEngine(target, None, max_len=64, attention="triton", attention_block_n=16,
                                attention_one_row_keys=8)
        res["min_rows"] = eng.attention_settings["min_rows"]
        res["exact"] = eng.generate(prompts, max_new_tokens=10, batch_size=1) == refs
        res["kernel"], res["sdpa"] = sorted({n for n, in kernel}), sorted({n for n, in sdpa})
        res["kernel_steps"] = eng.kernel_steps
        kernel.clear()
        sdpa.clear()
        pair = _prompts(5, (3, 4, 2))  # two rows of 3 and 4 tokens, then a refill of 2
        res["pair_exact"] = eng.generate(pair, max_new_tokens=10, batch_size=2) == _greedy_refs(target, pair, 10)
        res["pair_kernel"], res["pair_sdpa"] = sorted(set(kernel)), sorted(set(sdpa))
        res["pair_steps"] = eng.kernel_steps
        kernel.clear()
        comp = SpeculativeEngine(target, None, max_len=64, attention="triton", attention_block_n=16,
                                 attention_one_row_keys=8, compile="aot_eager")
        res["compiled_exact"] = comp.generate(prompts[:1], max_new_tokens=10) == refs[:1]
        res["compiled_traced_kernel"] = len(kernel) > 0
        print(json.dumps(res))
    """)
    assert out["exact"] and out["compiled_exact"], out
    assert out["min_rows"] == 2  # outside the switch, one-row calls stay on SDPA
    # prompt 1 (3 tokens): steps attending to 4..8 keys on the kernel, 9..12 on SDPA; prompt 2 (20): all on SDPA;
    # prompt 3 (2 tokens, after a refill): 3..8 on the kernel again
    assert out["kernel"] == list(range(3, 9)), out
    assert out["sdpa"] and min(out["sdpa"]) > 8 and 21 in out["sdpa"], out
    assert out["kernel_steps"] == 5 + 6, out
    assert out["compiled_traced_kernel"], out
    # two rows of 3 and 4 tokens: the longer one bounds the pair, 4 steps on the kernel (its 5..8 keys), then SDPA;
    # both finish together, the refill (2 tokens) goes to row 0 and takes the kernel for its 3..8 keys (6 steps)
    # beside row 1, read out at 13 keys and no longer counted
    assert out["pair_exact"], out
    both = [[4, 5], [5, 6], [6, 7], [7, 8]]
    assert out["pair_kernel"] == sorted(both + [[n, 13] for n in range(3, 9)]) and out["pair_steps"] == 10, out
    assert [8, 9] in out["pair_sdpa"] and [9, 13] in out["pair_sdpa"], out


def test_one_row_switch_replays_the_graph_captured_for_each_choice(monkeypatch):
    """The captured path of `attention_one_row_keys` on CPU, with stand-ins: a "graph" replays its round under the
    one-row setting it was captured with (as a CUDA graph keeps the kernels it recorded), and the kernel is SDPA that
    records its calls. Two graphs of the plain step are captured, one per choice, and each step replays the one its
    keys in use ask for; the text equals plain greedy decoding, at one row and at two (with a refill)."""
    import torch.nn.functional as F

    from test_engine import _greedy_refs, _prompts

    from hf_carryover.engine import attention, capture as capture_mod, engine as engine_mod, refill as refill_mod
    from hf_carryover.engine import triton_attention
    from hf_carryover.engine.graphs import restored

    captured_rows = []  # TRITON_SETTINGS["min_rows"] of each captured round

    def capture(round_fn, tensors, warmup=3, stream=None):
        rows = attention.TRITON_SETTINGS["min_rows"]
        with restored(tensors):
            round_fn()
        captured_rows.append(rows)

        def replay():  # under the setting it was captured with, whatever the host's settings are now
            before = attention.TRITON_SETTINGS["min_rows"]
            attention.TRITON_SETTINGS["min_rows"] = rows
            try:
                round_fn()
            finally:
                attention.TRITON_SETTINGS["min_rows"] = before
        return type("Graph", (), {"replay": staticmethod(replay)})()

    seen = []  # per one-row kernel call: the keys each batch row sees

    def kernel(q, k, v, mask, scale, *a, **kw):
        if q.shape[2] == 1:
            seen.append(tuple(mask[:, 0, -1].sum(-1).tolist()))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True).transpose(1, 2)

    monkeypatch.setattr(engine_mod, "_is_cuda", lambda device: True)
    monkeypatch.setattr(engine_mod, "triton_available", lambda device: None)
    monkeypatch.setattr(triton_attention, "available", lambda device: None)  # (the kernel's input check asks too)
    monkeypatch.setattr(capture_mod, "capture_round", capture)
    monkeypatch.setattr(refill_mod, "capture_round", capture)
    monkeypatch.setattr(attention, "masked_gqa_attention", kernel)
    target = build_target("qwen3", num_layers=2)
    prompts = _prompts(4, (3, 20, 2))
    refs = _greedy_refs(target, prompts, 10)
    eng = engine_mod.SpeculativeEngine(target, None, max_len=64, cuda_graphs=True, attention="triton",
                                       attention_block_n=16, attention_one_row_keys=8)
    assert eng.generate(prompts, max_new_tokens=10, batch_size=1) == refs
    rounds = [k for k, g in eng._graphs.items() if k[0] not in ("start", "restart")]
    assert sorted(k[-1] for k in rounds) == [1, 2]  # the plain step on the kernel and on SDPA, one graph each
    assert sorted({n for n, in seen}) == list(range(3, 9)) and eng.kernel_steps == 5 + 6
    assert 1 in captured_rows and attention.TRITON_SETTINGS["min_rows"] == 1  # the module's default, restored
    seen.clear()  # two rows with a refill, as in the eager test above: the same steps replay the kernel's graph
    pair = _prompts(5, (3, 4, 2))
    assert eng.generate(pair, max_new_tokens=10, batch_size=2) == _greedy_refs(target, pair, 10)
    both = [(4, 5), (5, 6), (6, 7), (7, 8)]
    assert sorted(set(seen)) == sorted(both + [(n, 13) for n in range(3, 9)]) and eng.kernel_steps == 10
    eng.one_row_max_rows = 1  # as "auto" does above 8 rows: a call of more rows keeps its one-row steps on SDPA
    seen.clear()
    assert eng.generate(prompts, max_new_tokens=10, batch_size=2) == refs
    assert seen == [] and eng.kernel_steps is None
    assert eng.generate(prompts, max_new_tokens=10, batch_size=1) == refs and eng.kernel_steps == 5 + 6


def test_gpu_engine_check_counts_one_row_kernel_steps(tmp_path):
    """`trainer/gpu_engine_check.py` records how many plain steps of each prompt set ran on the kernel under
    `attention_one_row_keys`, so a GPU check shows that the switch was crossed, not only that the text was exact.
    At batch 1 its sets are one prompt each, of 28 and 15 tokens: with N = 20 the first never takes the kernel, the
    second for the 5 steps launched while 15 + launches + 1 <= 20."""
    out = tmp_path / "check.json"
    cmd = [sys.executable, str(TESTS.parent / "trainer" / "gpu_engine_check.py"), "--device", "cpu", "--tiny",
           "--max_new_tokens", "8", "--reps", "1", "--dtypes", "fp32", "--kinds", "ar", "--batch_sizes", "1",
           "--attention", "triton", "--engine_options", "attention_one_row_keys=20", "--out", str(out)]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(TESTS.parent), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(out.read_text())
    (row,) = summary["rows"]
    assert summary["all_exact"] and row["exact"], row
    assert (row["one_row_keys"], row["one_row_kernel_steps"]) == (20, [0, 5]), row


def test_drafter_attention_on_the_kernel_equals_sdpa():
    """The kernel's key bias (the carryover gate) against SDPA with the same bias in an additive mask; a gated
    Carryover drafter's forward with its layers on `DrafterKernel` (cache rotated last) against SDPA; engines with
    the drafter on the kernel against the same engines with it on SDPA (fp32: same tokens and rounds)."""
    out = _run("""
        import torch.nn.functional as F
        from conftest import build_drafter, build_target
        from test_engine import _prompts
        from test_engine_tree import WIDE
        from hf_carryover.engine import attention
        from hf_carryover.engine.attention import DrafterKernel, use_drafter_kernel
        from hf_carryover.engine.engine import SpeculativeEngine
        from hf_carryover.engine.triton_attention import masked_gqa_attention
        from hf_carryover.modeling_drafter import DrafterStaticCache

        g = torch.Generator().manual_seed(0)
        res = {}
        Q = torch.randn(2, 6, 5, 16, generator=g)
        K, V = torch.randn(2, 2, 90, 16, generator=g), torch.randn(2, 2, 90, 16, generator=g)
        mask = torch.rand(2, 1, 5, 90, generator=g) < 0.7
        bias = torch.randn(6, generator=g) * 3
        for lo, hi in ((0, 0), (10, 25), (80, 90), (0, 90)):
            add = torch.zeros(6, 90)
            add[:, lo:hi] = bias[:, None]
            add = torch.where(mask, add[None, :, None, :], float("-inf"))  # [2, 6, 5, 90]
            ref = F.scaled_dot_product_attention(Q.double(), K.double(), V.double(), attn_mask=add.double(),
                                                 enable_gqa=True).transpose(1, 2)
            for split in (0, 32):
                for mode, bm in (("scan", 0), ("dense", 16)):  # the previous defaults and the engine's now
                    o = masked_gqa_attention(Q, K, V, mask, 16 ** -0.5, mode, 16, 4, split, bias, lo, hi, block_m=bm)
                    res[f"bias{lo}_{hi}s{split}" + ("" if mode == "scan" else "dense")] = (
                        (o.double() - ref).abs().max().item())

        target = build_target("qwen3", num_layers=2)  # two layers: see test_engine_with_triton_attention_...
        drafter = build_drafter(target, "dflash", True, carryover_gate=-1.5, target_layer_ids=[0])
        with torch.no_grad():
            drafter.carryover_gate.normal_(generator=g)  # a different bias per layer and head
        cfg = drafter.config
        cache = DrafterStaticCache(cfg.num_hidden_layers, 2, cfg.num_key_value_heads, 48, cfg.head_dim, torch.float32,
                                   "cpu")
        feats = torch.randn(2, 20, drafter.fc.in_features, generator=g)
        cache.write(drafter, drafter.fuse(feats), torch.arange(20)[None].expand(2, -1))
        anchor = torch.tensor([12, 19])
        B, k = cfg.block_size, cfg.num_proposals
        block = drafter.embed_block(torch.tensor([[3], [7]]))
        carry = torch.randn(2, k, drafter.fc.in_features, generator=g)
        carry_valid = torch.tensor([[True] * k, [True] + [False] * (k - 1)])
        ctx = torch.arange(48)[None] < anchor[:, None]
        m = torch.cat([ctx, carry_valid, torch.ones(2, B, dtype=torch.bool)], 1)[:, None, None, :]
        kw = dict(cache=cache, carryover_features=carry, carryover_positions=anchor[:, None] + 1 + torch.arange(k),
                  attn_mask=m)
        with torch.no_grad():
            ref = drafter(block, anchor[:, None] + torch.arange(B), **kw)
            calls = []
            real = attention.masked_gqa_attention
            attention.masked_gqa_attention = lambda *a, **kw: calls.append(a[-2:]) or real(*a, **kw)
            settings = {"mode": "scan", "block_n": 16, "num_warps": 4, "split_n": 16}
            with use_drafter_kernel(drafter, DrafterKernel(settings)):
                got = drafter(block, anchor[:, None] + torch.arange(B), **kw)
            attention.masked_gqa_attention = real
        res["drafter"] = (got - ref).abs().max().item()
        res["drafter_calls"] = calls  # (bias_lo, bias_hi) per layer: the carry rows first after the rotation
        res["restored"] = [layer.self_attn.kernel for layer in drafter.layers] == [None] * cfg.num_hidden_layers

        prompts = _prompts(0, (3, 9))
        for name, kw in (("linear", {}), ("tree", dict(tree=WIDE, tree_nodes=5, prompt_lookup_num_tokens=3))):
            runs = [SpeculativeEngine(target, drafter, max_len=64, attention="triton", attention_block_n=16,
                                      drafter_attention=how) for how in ("triton", "sdpa")]
            outs = [e.generate(prompts, max_new_tokens=12, **kw) for e in runs]
            res[name] = outs[0] == outs[1] and runs[0].rounds == runs[1].rounds
        res["modes"] = [runs[0].drafter_attention, SpeculativeEngine(target, drafter).drafter_attention,
                        SpeculativeEngine(target, drafter, attention="triton").drafter_attention,
                        SpeculativeEngine(target, drafter, attention="triton",
                                          drafter_attention="sdpa").drafter_attention]
        from hf_carryover.engine.attention import drafter_kernel  # remote code older than the hook: "auto" -> SDPA
        hookless = torch.nn.Sequential(torch.nn.Linear(2, 2))
        res["modes"].append("sdpa" if drafter_kernel(hookless, "auto", "triton", {}) is None else "triton")
        try:
            drafter_kernel(hookless, "triton", "triton", {})
            res["hookless_refused"] = None
        except ValueError as e:
            res["hookless_refused"] = str(e)
        try:
            SpeculativeEngine(target, drafter, drafter_attention="triton")
            res["refused"] = None
        except ValueError as e:
            res["refused"] = str(e)
        print(json.dumps(res))
    """)
    for name in ("bias0_0", "bias10_25", "bias80_90", "bias0_90"):
        assert out[name + "s0"] < 2e-6 and out[name + "s32"] < 2e-6, out
        assert out[name + "s0dense"] < 2e-6 and out[name + "s32dense"] < 2e-6, out
    assert out["drafter"] < 2e-5, out
    k = out["drafter_calls"][0][1]
    assert len(out["drafter_calls"]) == 2 and all(c == [0, k] for c in out["drafter_calls"]) and k > 0, out
    assert out["restored"] and out["linear"] and out["tree"], out
    # "auto" (the default): the kernel where the target's attention is on it (CPU: "auto" resolves to SDPA) and the
    # drafter's code has the hook
    assert out["modes"] == ["triton", "sdpa", "triton", "sdpa", "sdpa"], out
    assert "has no attention `kernel` hook" in out["hookless_refused"], out
    assert "drafter_attention='triton' needs attention='triton'" in out["refused"], out


def test_triton_attention_option_errors():
    target = build_target("qwen3", num_layers=2)
    from hf_carryover.engine.engine import SpeculativeEngine

    with pytest.raises(ValueError, match="attention='flash': 'auto', 'sdpa' or 'triton'"):
        SpeculativeEngine(target, attention="flash")
    assert SpeculativeEngine(target).attention == "sdpa"  # "auto" on a CPU target
    if not os.environ.get("TRITON_INTERPRET"):  # on CPU the kernel needs the interpreter: refused by name
        with pytest.raises(ValueError, match="attention='triton': off CUDA the kernel runs only in Triton's interp"):
            SpeculativeEngine(target, attention="triton")
    with pytest.raises(ValueError, match="attention_mode='fast'"):
        SpeculativeEngine(target, attention="triton", attention_mode="fast")
    with pytest.raises(ValueError, match="attention_block_n=48"):
        SpeculativeEngine(target, attention="triton", attention_block_n=48)
    with pytest.raises(ValueError, match="attention_split_n=-1: keys per split"):
        SpeculativeEngine(target, attention="triton", attention_split_n=-1)
    with pytest.raises(ValueError, match="attention_block_m=24: a power of two >= 16"):
        SpeculativeEngine(target, attention="triton", attention_block_m=24)
    with pytest.raises(ValueError, match="attention_min_rows=0: at least 1"):
        SpeculativeEngine(target, attention="triton", attention_min_rows=0)
    for bad in (0, -5, 1.5, True, "512"):
        with pytest.raises(ValueError, match="attention_one_row_keys=.*: a number of keys, at least 1"):
            SpeculativeEngine(target, attention_one_row_keys=bad)
    for attention in ("sdpa", "auto"):  # "auto" on a CPU target takes SDPA: nothing to switch between
        with pytest.raises(ValueError, match="attention_one_row_keys=512 switches .* attention is 'sdpa'"):
            SpeculativeEngine(target, attention=attention, attention_one_row_keys=512)
    with pytest.raises(ValueError, match="attention_key_end='yes': True or False"):
        SpeculativeEngine(target, attention_key_end="yes")


def test_auto_attention_takes_the_kernel_for_half_precision_cuda_targets(monkeypatch):
    """"auto" (the default) resolves by device, dtype and Triton: the kernel only where it was measured faster
    (bf16 / fp16 on CUDA, calls of two query rows or more); fp32 targets stay on SDPA (the kernel is exact there, but
    slow), as do CPU targets."""
    from hf_carryover.engine import engine as engine_mod

    target = build_target("qwen3", num_layers=2)
    monkeypatch.setattr(engine_mod, "_is_cuda", lambda device: True)  # no GPU here: pretend the target is on CUDA
    monkeypatch.setattr(engine_mod, "triton_available", lambda device: None)
    fp32 = engine_mod.SpeculativeEngine(target)
    assert fp32.attention == "sdpa" and fp32.one_row_keys(1) is None  # fp32: SDPA, nothing to switch to
    auto = engine_mod.SpeculativeEngine(target.to(torch.bfloat16))
    assert auto.attention == "triton" and auto.attention_settings["min_rows"] == 2  # one-row steps on SDPA
    # the settings measured fastest at a tree round's 47 rows (h200-2026-12-04d)
    assert {k: auto.attention_settings[k] for k in ("mode", "block_m")} == {"mode": "dense", "block_m": 16}
    named = engine_mod.SpeculativeEngine(target, attention="triton")
    assert named.attention_settings["min_rows"] == 1  # the kernel wherever it applies
    # one-row steps chosen by their keys in use: min_rows 2 outside the switch; "auto" switches at 512 keys in
    # calls of up to 8 rows, and only where nothing asked otherwise
    assert [auto.one_row_keys(b) for b in (1, 2, 8, 9, 16)] == [512, 512, 512, None, None]
    assert named.one_row_keys(1) is None  # "triton" by name: every one-row step on the kernel
    assert engine_mod.SpeculativeEngine(target, attention_min_rows=2).one_row_keys(1) is None
    off = engine_mod.SpeculativeEngine(target, attention_one_row_keys=None)
    assert off.one_row_keys(1) is None and off.attention_settings["min_rows"] == 2
    switch = engine_mod.SpeculativeEngine(target, attention="triton", attention_one_row_keys=512)
    assert switch.one_row_keys(16) == 512 and switch.attention_settings["min_rows"] == 2  # a number: every batch
    with pytest.raises(ValueError, match="attention_min_rows=1 puts them all on the kernel"):
        engine_mod.SpeculativeEngine(target, attention="triton", attention_one_row_keys=512, attention_min_rows=1)
    assert engine_mod.SpeculativeEngine(target, attention="sdpa").attention == "sdpa"  # asked for by name
    monkeypatch.setattr(engine_mod, "triton_available", lambda device: "Triton is not installed")
    assert engine_mod.SpeculativeEngine(target).attention == "sdpa"
