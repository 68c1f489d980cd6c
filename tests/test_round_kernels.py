"""The tree round's two Triton kernels besides attention, checked on CPU in Triton's interpreter: the drafter's
vocabulary top-R (`vocab_topk.py`) against an exact ranking, the few-row GEMM (`skinny_gemm.py`) against float64, and
engines that use them (`draft_topk="triton"`, `skinny_rows`) against plain greedy decoding and the torch engine.

As in `test_triton_attention.py`, the interpreter must be on before Triton is imported, so the checks run in a fresh
interpreter; the models are tiny. `fused_linear`'s kernels are also compiled for sm_90 (no GPU needed), which the
interpreter cannot stand in for."""

import sys
from pathlib import Path

import pytest
from test_triton_attention import _run

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("triton")


def test_vocab_topk_ranks_by_logit_and_gives_log_softmax():
    """Float32 and bf16 logits, vocabularies that do and do not fill the last 1024-token chunk, ties inside a chunk and
    across chunks (the lower token id first), leading batch dims, r from 1 to 8, logits that are strided views (a
    slice of rows, one row, a broadcast, steps): the tokens are the r largest logits in order, the values float32
    log_softmax at them."""
    out = _run("""
        from hf_carryover.engine.vocab_topk import draft_topk, vocab_topk

        g = torch.Generator().manual_seed(0)
        res = {"cases": 0}

        def exact(x, r):  # ranks by logit, ties to the lower id: a stable sort of -x
            order = torch.sort(-x.float(), dim=-1, stable=True).indices[..., :r]
            return x.double().log_softmax(-1).gather(-1, order), order

        for shape, r in (((1, 15, 49152), 8), ((2, 3, 5000), 4), ((4, 1000), 8), ((3, 7), 7), ((2, 2048), 1)):
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(*shape, generator=g) * 3).to(dtype)
                x[..., 5] = x[..., 1030 % shape[-1]] = x.max() + 1  # a tie at the top, across two chunks
                vals, ids = vocab_topk(x, r)
                ref_v, ref_i = exact(x, r)
                assert vals.dtype == torch.float32 and ids.dtype == torch.long and ids.shape == ref_i.shape
                assert torch.equal(ids, ref_i), (shape, r, dtype)
                assert (vals.double() - ref_v).abs().max() < 1e-5, (shape, r, dtype)
                res["cases"] += 1
        # strided views (a tree round passes the [b, :D] slice of the drafter's [b, P, V] logits)
        full = torch.randn(3, 6, 2500, generator=g)
        for x in (full[:, :4], full[1, 2], full[:2, :3, None].expand(2, 3, 2, 2500), full[::2, 1::2]):
            vals, ids = vocab_topk(x, 5)
            ref_v, ref_i = exact(x, 5)
            assert torch.equal(ids, ref_i) and (vals.double() - ref_v).abs().max() < 1e-5, tuple(x.shape)
            res["cases"] += 1
        x = torch.randn(2, 4, 3000, generator=g)
        kv, ki = draft_topk(x, 8, True)
        tv, ti = draft_topk(x, 8, False)
        res["draft_topk_same"] = torch.equal(ki, ti) and bool((kv - tv).abs().max() < 1e-5)
        print(json.dumps(res))
    """)
    assert out["cases"] == 14 and out["draft_topk_same"], out


def test_skinny_mm_equals_float64_and_refuses_bad_shapes():
    """`skinny_mm` at 1-64 rows, widths that do not fill a block, a weight stored [N, K] (nn.Linear) and [K, N] (a
    transposed view), every kernel setting the engine picks: within float32's worst-case rounding of the float64
    product (k * 2^-24 * |x| |w|: any float32 sum of the right products stays below it); more
    than 64 rows and mismatched widths are refused by name."""
    out = _run("""
        from hf_carryover.engine.skinny_gemm import settings, silu_mul_mm, skinny_mm

        g = torch.Generator().manual_seed(0)
        worst, n_cases = 0.0, 0
        for m, n, k in ((1, 40, 72), (8, 64, 576), (16, 33, 130), (32, 96, 1600), (47, 17, 300), (64, 48, 64)):
            x = torch.randn(m, k, generator=g)
            w = torch.randn(n, k, generator=g)
            ref = x.double() @ w.double().T
            bound = k * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)  # float32's worst case for k products
            for wt in (w, w.T.contiguous().T):
                for cfg in (settings(m, k), (16, 64, 4, 2), (32, 128, 2, 1)):
                    y = skinny_mm(x, wt, *cfg)
                    assert y.shape == (m, n) and y.dtype == torch.float32
                    worst = max(worst, ((y.double() - ref).abs() / bound).max().item())
                    n_cases += 1
        # silu_mul_mm: the gated MLP's down projection, gate and up as the two halves of one [M, 2K] tensor
        worst_gated = 0.0
        for dtype in (torch.float32, torch.float64):
            gu = torch.randn(24, 2 * 96, generator=g, dtype=dtype)
            w = torch.randn(40, 96, generator=g, dtype=dtype)
            gate, up = gu[:, :96], gu[:, 96:]
            y = silu_mul_mm(gate, up, w, *settings(24, 96))
            x = torch.nn.functional.silu(gate.double()) * up.double()
            ref = x @ w.double().T
            bound = 96 * 2.0 ** -24 * (x.abs() @ w.double().abs().T) + 1e-300
            worst_gated = max(worst_gated,
                              ((y.double() - ref).abs() / bound).max().item())
        errors = []
        for x, w in ((torch.randn(65, 8), torch.randn(4, 8)), (torch.randn(2, 8), torch.randn(4, 9))):
            try:
                skinny_mm(x, w)
            except ValueError as e:
                errors.append(str(e))
        print(json.dumps({"worst": worst, "cases": n_cases, "errors": errors, "worst_gated": worst_gated}))
    """)
    assert out["cases"] == 36 and out["worst"] < 1, out  # a product missed or counted twice: >> 1
    # float32: the product rounded to float32 before the dot, as a separate kernel would store it (within the bound);
    # float64: within float64's own rounding, far below float32's bound
    assert out["worst_gated"] < 1, out
    assert "at most 64 rows" in out["errors"][0] and "[M, K] and [N, K]" in out["errors"][1], out


def test_fit_block_k_keeps_the_pipelined_tiles_in_shared_memory():
    """The K step shrinks where `num_stages` copies of the input tiles would not fit the card's shared memory (an
    H100's 232448 bytes): with block_k 512, bf16 at 64 rows asked the GPU for 245760 bytes and fp32 SiLU * up at 32
    rows for 393216 (`h100-2026-12-06d`); the bf16 settings timed at up to 32 rows keep their step; no limit, no
    change."""
    from hf_carryover.engine.skinny_gemm import fit_block_k

    h100 = 232448
    assert fit_block_k(64, 16, 512, 3, 2, False, h100) < 512 and fit_block_k(32, 16, 512, 3, 4, True, h100) < 512
    assert fit_block_k(32, 16, 512, 3, 2, False, h100) == 512 and fit_block_k(16, 16, 512, 2, 2, False, h100) == 512
    for m, bk, st, size, gated in ((64, 512, 3, 8, True), (64, 256, 4, 4, True), (16, 128, 2, 2, False)):
        got = fit_block_k(m, 16, bk, st, size, gated, h100)
        assert got <= bk and (got == 32 or st * (m * (1 + gated) + 16) * got * size <= h100), (m, bk, got)
    assert fit_block_k(64, 16, 512, 3, 8, True, None) == 512  # Triton's interpreter: no limit


def test_engines_with_the_round_kernels_equal_plain_greedy():
    """Tree rounds (a dynamic tree with lookup, a Carryover drafter) with the drafter's top-R on `vocab_topk` give
    plain greedy decoding's tokens and, in float32 (no ties), the torch engine's rounds; a compiled engine with frozen
    weights hands its tree rounds' GEMMs of 2-64 rows to `skinny_mm` and its gated MLPs' down projections to
    `silu_mul_mm` (`skinny_rows`, `gated_mlp=True`) and still decodes those tokens, again on a second call without
    recompiling; without `gated_mlp` the MLPs keep their forward. Options that cannot work are refused by name."""
    out = _run("""
        from conftest import build_drafter, build_target
        from test_engine import _greedy_refs, _prompts
        from test_engine_tree import WIDE
        from hf_carryover.engine.engine import SpeculativeEngine

        res = {}
        target = build_target("llama", num_layers=2)
        drafter = build_drafter(target, "dflash", True, target_layer_ids=[0])
        prompts = _prompts(2, (3, 9))
        refs = _greedy_refs(target, prompts, 14)
        kw = dict(max_new_tokens=14, tree=WIDE, tree_nodes=5, prompt_lookup_num_tokens=3)
        torch_eng = SpeculativeEngine(target, drafter, max_len=96)
        res["torch"] = torch_eng.generate(prompts, **kw) == refs
        tri = SpeculativeEngine(target, drafter, max_len=96, draft_topk="triton")
        res["triton"] = tri.generate(prompts, **kw) == refs
        res["same_rounds"] = tri.rounds == torch_eng.rounds
        auto = SpeculativeEngine(target, drafter, max_len=96, draft_topk="auto")
        res["draft_topk"] = [tri.draft_topk, auto.draft_topk]
        target64, drafter64 = target.double(), drafter.double()
        refs64 = _greedy_refs(target64, prompts, 12)
        comp = SpeculativeEngine(target64, drafter64, max_len=96, compile=True, skinny_rows=64, gated_mlp=True,
                                 compile_options={"freezing": True, "fx_graph_cache": False})
        from torch._inductor.utils import run_and_get_code

        out64, codes = run_and_get_code(lambda: comp.generate(prompts, max_new_tokens=12, tree=WIDE, tree_nodes=5))
        res["skinny"] = out64 == refs64
        res["gated_calls"] = sum(c.count("silu_mul_mm") for c in codes)  # in the compiled rounds' code
        res["skinny_record"] = comp.fused_projections.record()
        res["gated_mlps"] = len(comp.gated_mlps.modules)  # the target's 2 layers and the drafter's
        res["kernel_record"] = comp.kernel_record()  # what benchmark and profile rows record of the engine
        res["restored"] = all("forward" not in m.__dict__ for m in comp.gated_mlps.modules)
        frames = dict(torch._dynamo.utils.counters["frames"])
        res["again"] = comp.generate(prompts, max_new_tokens=12, tree=WIDE, tree_nodes=5) == refs64
        res["recompiled"] = dict(torch._dynamo.utils.counters["frames"]) != frames
        plain_mlps = SpeculativeEngine(target64, drafter64, max_len=96, compile=True, skinny_rows=64,
                                       compile_options={"freezing": True})
        res["gated_off"] = plain_mlps.gated_mlps is None and plain_mlps.skinny_rows == 64
        errors = []
        for bad in (dict(draft_topk="fast"), dict(skinny_rows=8), dict(skinny_rows=-1), dict(gated_mlp="no"),
                    dict(gated_mlp=True)):
            try:
                SpeculativeEngine(target, drafter, max_len=96, **bad)
            except ValueError as e:
                errors.append(str(e))
        res["errors"] = errors
        print(json.dumps(res))
    """)
    assert out["torch"] and out["triton"] and out["same_rounds"], out
    assert out["draft_topk"] == ["triton", "torch"], out  # "auto" takes the kernel on CUDA only
    assert out["skinny"] and out["skinny_record"]["skinny_gemms"] > 0, out
    # the gated MLPs: swapped while decoding, their class forward back after, no recompile on the next call
    assert out["gated_mlps"] >= 3 and out["gated_calls"] > 0, out
    assert out["kernel_record"] == {**out["skinny_record"], "gated_mlps": out["gated_mlps"], "draft_topk": "torch"}, out
    assert out["restored"] and out["again"] and not out["recompiled"], out
    errors = out["errors"]
    assert "draft_topk='fast'" in errors[0] and "skinny_rows=8" in errors[1] and "freezing" in errors[1], out
    assert "skinny_rows=-1: a number of rows" in errors[2], out
    assert out["gated_off"] and "gated_mlp='no'" in errors[3], out  # the default: the kernel GEMMs only
    assert "gated_mlp=True" in errors[4] and "needs skinny_rows > 0 (here 0)" in errors[4], out


def test_fused_linear_equals_the_eager_modules_and_refuses_bad_shapes():
    """`fused_linear` with every combination of its folds (RMSNorm before, SiLU(gate) * up or a residual add after) at
    1-64 rows (the one-row kernel and the tiled one), widths that do not fill a block, a weight stored [N, K] and as a
    transposed view, and the engine's settings and others: float64 within float64's rounding where nothing is
    normalised (the norm is float32 by design, as LlamaRMSNorm computes it) and within float32's elsewhere; float32
    within float32's. (Triton's interpreter rounds bf16 differently from the GPU, so bf16 is checked on the GPU:
    `trainer/gpu_kernel_sanity.py`.) Bad shapes are refused by name."""
    out = _run("""
        import itertools

        from hf_carryover.engine.fused_linear import fused_linear, reference, settings

        g = torch.Generator().manual_seed(0)
        worst, cases = {}, 0
        for (m, n, k), dtype in itertools.product(((1, 40, 72), (1, 24, 1536), (3, 64, 576), (16, 33, 130),
                                                   (33, 24, 300), (64, 8, 64)), (torch.float64, torch.float32)):
            for norm, glu, resid in itertools.product((False, True), repeat=3):
                x = torch.randn(m, k, generator=g, dtype=dtype)
                w = torch.randn(2 * n if glu else n, k, generator=g, dtype=dtype) / k ** 0.5
                nw = 1 + 0.1 * torch.randn(k, generator=g, dtype=dtype) if norm else None
                r = torch.randn(m, n, generator=g, dtype=dtype) if resid else None
                ref = reference(x.double(), w.double(), None if nw is None else nw.double(), 1e-6,
                                None if r is None else r.double(), glu)
                for wt, cfg in ((w, settings(m, n, k, glu)), (w.T.contiguous().T, (8, 64, 2))):
                    y = fused_linear(x, wt, nw, 1e-6, r, glu, *cfg)
                    assert y.shape == (m, n) and y.dtype == dtype
                    err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
                    key = f"{dtype}_{'norm' if norm else 'plain'}"
                    worst[key] = max(worst.get(key, 0.0), err)
                    cases += 1
        errors = []
        x, w = torch.randn(2, 8), torch.randn(6, 8)
        for bad in (dict(x=torch.randn(65, 8)), dict(w=torch.randn(6, 9)), dict(w=torch.randn(5, 8), glu=True),
                    dict(norm_weight=torch.randn(7)), dict(residual=torch.randn(2, 5))):
            try:
                fused_linear(**{"x": x, "w": w, **bad})
            except ValueError as e:
                errors.append(str(e))
        print(json.dumps({"worst": worst, "cases": cases, "errors": errors}))
    """)
    worst = out["worst"]
    assert out["cases"] == 192, out
    from hf_carryover.engine.fused_linear import norm_chunk  # the norm's chunks: K=576 in nine of 64 (no masked
    # squares), 130 and 300 (no power of two of 16 and more divides them) in masked block_k-wide ones, both checked
    # above
    assert [norm_chunk(k, bk) for k, bk in ((576, 256), (130, 256), (300, 64), (1536, 512), (64, 256))] == [
        64, 256, 64, 512, 64]
    assert worst["torch.float64_plain"] < 1e-13 and worst["torch.float64_norm"] < 1e-5, out  # norm: float32 steps
    assert worst["torch.float32_plain"] < 1e-5 and worst["torch.float32_norm"] < 1e-5, out  # a missed product: ~1e-1
    errors = out["errors"]
    assert len(errors) == 5 and "at most 64 rows" in errors[0] and "[M, K] and [N, K]" in errors[1], out
    assert "an even count" in errors[2] and "norm_weight (7,)" in errors[3] and "residual (2, 5)" in errors[4], out


def test_fused_linear_kernels_compile_for_hopper():
    """Both `fused_linear` kernels, every fold, bf16 (and float32 with all folds: the IEEE products), through
    Triton's compiler for sm_90 down to a cubin (Triton's own ptxas; no GPU needed; the variants of
    `examples/kernel_ptx.py`, which hashes their PTX to compare commits). Why: the interpreter runs the kernels as
    Python, so an error of Triton's GPU frontend (a type that changes across a branch, a helper's constexpr argument)
    passes the interpreter tests and fails only on the machine. Numbers are the GPU's to check
    (`trainer/gpu_kernel_sanity.py`)."""
    import inspect

    compiler = pytest.importorskip("triton.compiler")
    if "constexprs" not in inspect.signature(compiler.ASTSource).parameters:  # older Triton: `constants`
        pytest.skip(f"Triton {pytest.importorskip('triton').__version__}'s ASTSource takes no `constexprs`")
    sys.path.insert(0, str(ROOT / "examples"))
    from kernel_ptx import code_only, variants

    from hf_carryover.engine import fused_linear as fl

    built = {key: binary.asm["ptx"] for key, binary in variants(fl) if binary.asm["cubin"]}
    assert len(built) == 18, list(built)
    ptx = built["rows_bf16_NGR"]  # the digest's text keeps the code and drops what names the source file and lines
    code = code_only(ptx)
    assert ".loc" in ptx and ".debug" in ptx and ".loc" not in code and ".debug" not in code, code[-400:]
    assert "mma" in code and code.count("ld.global") == ptx.count("ld.global") and "ret;" in code, code[-400:]


def test_engines_with_folded_linears_equal_plain_greedy():
    """`fused_linear_rows` (compile with frozen weights): a plain engine's one-row steps and a tree engine's rounds
    (a Carryover drafter, lookup) run their projections on `fused_linear`, with each layer's two RMSNorms, SiLU(gate)
    * up and two residual adds and the final norm folded in, and decode plain greedy decoding's tokens (float64), on
    Llama and Qwen3 targets; the compiled row prefill (a dynamic width) folds its one-row head. With inductor's own
    gate/up merge (a `split` whose halves it may order up first; forced here with `cpp.enable_concat_linear`, as on
    CUDA) the SiLU * up is still folded. The tree engine again with `fused_linear.TILED_MAX_N` lowered below the
    tiny vocabulary: the same tokens, the same folds except the multi-row heads, left to the mm. Options that cannot
    work are refused by name."""
    out = _run("""
        from conftest import build_drafter, build_target
        from test_engine import _greedy_refs, _prompts
        from test_engine_tree import WIDE
        from hf_carryover.engine.engine import SpeculativeEngine

        res = {}
        frozen = {"freezing": True, "fx_graph_cache": False}
        prompts = _prompts(2, (3, 9))
        for arch in ("llama", "qwen3"):
            target = build_target(arch, num_layers=2).double()
            refs = _greedy_refs(target, prompts, 12)
            plain = SpeculativeEngine(target, None, max_len=96, compile=True, fused_linear_rows=1,
                                      compile_options=frozen)
            if arch == "llama":  # one row for both prompts in turn: the compiled row prefill (dynamic width) too
                res[f"{arch}_plain"] = [plain.generate(prompts, max_new_tokens=12, batch_size=1) == refs]
            else:
                res[f"{arch}_plain"] = [plain.generate([p], max_new_tokens=12) == [r] for p, r in zip(prompts, refs)]
            res[f"{arch}_plain_record"] = plain.kernel_record()
            if arch == "llama":
                merged = SpeculativeEngine(target, None, max_len=96, compile=True, fused_linear_rows=1,
                                           compile_options={**frozen, "cpp.enable_concat_linear": True})
                res["split"] = merged.generate(prompts[:1], max_new_tokens=12) == refs[:1]
                res["split_record"] = merged.kernel_record()
            else:
                continue  # the tree round's rows once (Qwen3's q/k norms are checked by the plain steps)
            drafter = build_drafter(target, "dflash", True, target_layer_ids=[0]).double()
            tree = SpeculativeEngine(target, drafter, max_len=96, compile=True, fused_linear_rows=32,
                                     compile_options=frozen)
            res[f"{arch}_tree"] = tree.generate(prompts, max_new_tokens=12, tree=WIDE, tree_nodes=5,
                                                prompt_lookup_num_tokens=3) == refs
            res[f"{arch}_tree_record"] = tree.kernel_record()
            from hf_carryover.engine import fused_linear

            fused_linear.TILED_MAX_N = 80  # the vocabulary 96 wider, the projections (64 at most) not
            narrow = SpeculativeEngine(target, drafter, max_len=96, compile=True, fused_linear_rows=32,
                                       compile_options=frozen)
            res[f"{arch}_narrow"] = narrow.generate(prompts, max_new_tokens=12, tree=WIDE, tree_nodes=5,
                                                    prompt_lookup_num_tokens=3) == refs
            res[f"{arch}_narrow_record"] = narrow.kernel_record()
        errors = []
        target = build_target("llama", num_layers=2)
        for bad in (dict(fused_linear_rows=8), dict(fused_linear_rows=-1), dict(fused_linear_rows=True)):
            try:
                SpeculativeEngine(target, None, max_len=96, **bad)
            except ValueError as e:
                errors.append(str(e))
        print(json.dumps({**res, "errors": errors}))
    """)
    for arch in ("llama", "qwen3"):
        assert out[f"{arch}_plain"] == ([True] if arch == "llama" else [True, True]), out  # llama: both prompts at once
        rec = out[f"{arch}_plain_record"]  # a plain step of 2 layers (q/k/v, o, gate/up, down) + head; with the row
        # prefill (llama) also its head, bare: it takes the last position's row (`logits_to_keep`) after the norm
        folds = (rec["fused_linears"], rec["fused_norms"], rec["fused_glus"], rec["fused_residuals"])
        assert folds == ((10 if arch == "llama" else 9), 5, 2, 4), out
    tree = out["llama_tree_record"]  # target and drafter layers in the tree round and the row prefills
    assert out["llama_tree"] and tree["fused_linears"] > 9, out
    assert tree["fused_glus"] > 2 and tree["fused_residuals"] > 4, out
    assert out["split"] and out["split_record"]["fused_glus"] == 2 and out["split_record"]["fused_gemms"] == 0, out
    narrow, rec = out["llama_narrow"], out["llama_narrow_record"]  # the same rounds, the multi-row heads no longer
    # folded (not each of them had a norm folded)
    assert narrow, out
    heads = tree["fused_linears"] - rec["fused_linears"]
    assert heads > 0 and 0 < tree["fused_norms"] - rec["fused_norms"] <= heads and rec["fused_norms"] > 2, out
    assert (rec["fused_glus"], rec["fused_residuals"]) == (tree["fused_glus"], tree["fused_residuals"]), out
    errors = out["errors"]
    assert "fused_linear_rows=8" in errors[0] and "freezing" in errors[0], out
    assert "fused_linear_rows=-1: 'auto', or a number of rows" in errors[1], out
    assert "fused_linear_rows=True" in errors[2], out
    assert len(errors) == 3, out
