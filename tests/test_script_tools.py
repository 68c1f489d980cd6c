"""Tests of the example and trainer scripts' analysis and measurement helpers (tables, round comparisons, offline
replays, profilers, plots) on tiny in-process inputs; the scripts that decode or train end to end through transformers
are smoke-tested in test_scripts.py."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import build_drafter

ROOT = Path(__file__).resolve().parents[1]


def test_compare_rounds(tmp_path, monkeypatch):
    """Round-for-round comparison of two τ runs: any difference, an extra last round included, counts."""
    sys.path.insert(0, str(ROOT / "examples"))
    import compare_rounds

    def raw(path, rows):
        path.write_text("".join(json.dumps({"drafter": "d", "dataset": "x", "temperature": 0.0, "id": i,
                                            "accepted": acc}) + "\n" for i, acc in rows))
        return str(path)

    a = raw(tmp_path / "a.jsonl", [(1, [3, 0, 2]), (2, [1, 1]), (3, [0, 4])])
    b = raw(tmp_path / "b.jsonl", [(1, [3, 0, 2]), (2, [1, 1, 0]), (3, [4, 0])])  # 2: one more round
    out = tmp_path / "cmp.json"
    monkeypatch.setattr(sys, "argv", ["compare_rounds.py", a, b, "--out", str(out)])
    compare_rounds.main()  # its command line, in this process (a new one would spend ~6 s importing torch)
    g = json.loads(out.read_text())["groups"]["d|x|T=0.0"]
    assert g["prompts"] == 3 and g["same_rounds"] == 1 and g["differing_ids"] == ["2", "3"]
    assert abs(g["tau_a"] - (11 + 7) / 7) < 1e-9  # 11 accepted drafts in 7 rounds


def test_paired_tau(tmp_path):
    """Per-prompt τ differences on the prompts both drafters decoded, with the standard error of their mean."""
    sys.path.insert(0, str(ROOT / "examples"))
    import paired_tau

    recs = [("a", "d", 1, [1, 1]), ("b", "d", 1, [0, 0]),   # τ 2 vs 1
            ("a", "d", 2, [0]), ("b", "d", 2, [1, 0]),      # τ 1 vs 1.5
            ("a", "d", 3, [2]), ("b", "e", 3, [0])]         # no partner: left out
    raw = tmp_path / "raw-engine.jsonl"
    raw.write_text("".join(json.dumps({"drafter": n, "dataset": ds, "temperature": 0.0, "id": i, "accepted": acc})
                           + "\n" for n, ds, i, acc in recs))
    out = tmp_path / "paired.json"
    paired_tau.main(["--raw", str(raw), "--pair", "a:b", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert {"commit", "gpu", "torch", "transformers"} <= set(saved["environment"])  # who measured, with what
    r = saved["pairs"]["a:b"]
    assert r["all"]["prompts"] == 2 and r["all"]["mean_diff"] == pytest.approx(0.25)
    assert r["all"]["se"] == pytest.approx(0.75)  # diffs +1 and -0.5: sd 1.0607, / sqrt(2)
    assert r["all"]["tau_a"] == pytest.approx(5 / 3) and r["all"]["tau_b"] == pytest.approx(5 / 4)
    assert (r["all"]["a_better"], r["all"]["b_better"]) == (1, 1) and set(r) == {"d|T=0.0", "all|T=0.0", "all"}
    # a second temperature: each temperature on its own beside the pooled group
    with raw.open("a") as f:
        for n, acc in (("a", [0]), ("b", [3])):  # τ 1 vs 4 at T=1
            f.write(json.dumps({"drafter": n, "dataset": "d", "temperature": 1.0, "id": 1, "accepted": acc}) + "\n")
    paired_tau.main(["--raw", str(raw), "--pair", "a:b", "--out", str(out)])
    r = json.loads(out.read_text())["pairs"]["a:b"]
    assert r["all|T=0.0"]["mean_diff"] == pytest.approx(0.25) and r["all|T=1.0"]["mean_diff"] == pytest.approx(-3)
    assert r["all"]["prompts"] == 3 and r["all"]["mean_diff"] == pytest.approx((1 - 0.5 - 3) / 3)
    with pytest.raises(SystemExit, match="no records for"):
        paired_tau.main(["--raw", str(raw), "--pair", "a:zz", "--out", str(out)])
    # PREFIX=FILE: the same file read twice under two prefixes pairs a drafter with itself (difference 0), and
    # pairs old-a with new-b as a with b
    paired_tau.main(["--raw", f"old-={raw}", f"new-={raw}", "--pair", "old-a:new-a", "old-a:new-b", "--out", str(out)])
    r = json.loads(out.read_text())["pairs"]
    assert r["old-a:new-a"]["all"]["mean_diff"] == 0 and r["old-a:new-a"]["all"]["prompts"] == 4  # d3 too
    assert r["old-a:new-b"]["all"]["mean_diff"] == pytest.approx((1 - 0.5 - 3) / 3)


def test_carryover_signal_by_accepted(tmp_path):
    """The carryover-signal probe on a tiny target: the split by accepted drafts partitions the rejections."""
    sys.path.insert(0, str(ROOT / "examples"))
    import carryover_signal
    from test_training import tiny_target

    from hf_carryover.training.data import regenerate_responses

    target = tiny_target()
    target.save_pretrained(tmp_path / "target")
    build_drafter(target, "dflash", False).save_pretrained(tmp_path / "drafter")
    regenerate_responses(target, [(f"p{i}", [3 + i, 9, 4, 7]) for i in range(4)], tmp_path / "data",
                         max_new_tokens=24, batch_size=4)
    out = tmp_path / "signal.json"
    carryover_signal.main(["--drafter", str(tmp_path / "drafter"), "--target", str(tmp_path / "target"),
                           "--data", str(tmp_path / "data"), "--limit", "4", "--num_anchors", "8", "--out", str(out)])
    r = json.loads(out.read_text())
    by = r["by_accepted"]
    assert r["rejections"] > 0 and sum(b["rejections"] for b in by.values()) == r["rejections"]
    for key in ("row_right", "drafter_right", "headroom"):  # bucket rates recombine into the overall rate
        total = sum(b[f"{key}_rate"] * b["rejections"] for b in by.values())
        overall = r["first_rejected_row_right" if key == "row_right" else key] * r["rejections"]
        assert total == pytest.approx(overall, abs=0.01 * len(by))
    assert all(b["headroom_rate"] <= b["row_right_rate"] for b in by.values())


def test_anchor_bias_verified_run(tmp_path):
    """anchor_bias.leading_runs: on the target's own greedy text every token is its argmax, so the verified run is
    the plain run; on a text with a token the target would not choose, that token is counted as not-argmax and no
    proposal through it is verified."""
    sys.path.insert(0, str(ROOT / "examples"))
    import anchor_bias
    from test_offline_tau import overfit
    from test_training import tiny_target

    target = tiny_target().eval()
    prompt = [3, 7, 11, 5]
    greedy = target.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0].tolist()
    drafter = overfit(build_drafter(target, "dflash", False), target, [(len(prompt), greedy, None)], steps=60).eval()
    run, verified, off = anchor_bias.leading_runs(target, drafter, greedy, len(prompt))
    assert off == 0 and torch.equal(run, verified) and run.float().mean() > 1  # the overfitted drafter follows it
    bent = list(greedy)
    i = len(prompt) + 6
    bent[i] = next(t for t in range(3, 60) if t != greedy[i])  # not the argmax after greedy[:i]
    run_b, verified_b, off_b = anchor_bias.leading_runs(target, drafter, bent, len(prompt))
    assert off_b > 0 and bool((verified_b <= run_b).all())
    # anchors before position i whose proposals reach it stop there when verified
    a = i - len(prompt) - 1  # the anchor right before the bent token: its first proposal is bent[i]
    assert verified_b[a] == 0
    assert anchor_bias.repeated_ngram_share([1, 2, 3, 4, 1, 2, 3, 4], 4) == pytest.approx(1 / 5)  # (1,2,3,4) twice
    assert anchor_bias.repeated_ngram_share([1, 2, 3], 4) == 0.0
    known = anchor_bias.ngram_hashes(list(range(20)), 8)
    assert anchor_bias.familiar_share(list(range(10)) + [99, 98, 97], known, 8) == pytest.approx(3 / 6)


def test_lookup_hybrid_rules():
    """Prompt-lookup proposals copy the continuation of the earliest match of the context's suffix, from
    the context only; the replay accepts leading matches with the rollout and advances by accepted + 1; the
    two-branch rule is never below either single rule."""
    sys.path.insert(0, str(ROOT / "examples"))
    import lookup_hybrid_offline as lh

    toks = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3]
    # suffix (1, 2, 3) at t=10 (no earlier 4-gram match): the earliest match starts at 0, followed by 9, 1, 2, 3
    assert lh.lookup_proposals(toks, 10, 4) == ([9, 1, 2, 3], 3)
    assert lh.lookup_proposals([5, 6, 7], 2, 4) == ([], 0)
    assert lh.lookup_proposals(toks, 10, 2) == ([9, 1], 3)  # cut to num
    assert lh.lookup_proposals([7, 1, 2, 1, 2], 4, 9) == ([1, 2], 2)  # context only: nothing past t is copied
    loop = [4, 5] + [1, 2] * 10  # prompt of 2, then a 2-token loop
    plen = 2
    none = torch.zeros(len(loop) - 1 - plen, 3, dtype=torch.long)  # a drafter that never hits
    assert lh.replay(loop, plen, none, "drafter", 3) == [0] * (len(loop) - 2 - plen)
    look = lh.replay(loop, plen, none, "lookup", 3)
    # every token but a last plain step comes from draft rounds; whole 3-token blocks are copied in the loop
    assert sum(a + 1 for a in look) in (len(loop) - 1 - plen, len(loop) - 2 - plen) and max(look) == 3
    for rule in ("lookup", "hybrid", "drafter"):
        assert len(lh.replay(loop, plen, none, "both", 3)) <= len(lh.replay(loop, plen, none, rule, 3))
    # a drafter that is always right: a lookup shorter than the block (2 of 3 slots, early in the loop) ends the hybrid
    # round there, while hybrid_fill goes on with the drafter's proposal for the third slot
    oracle = torch.tensor([[loop[t + 1 + j] if t + 1 + j < len(loop) else 0 for j in range(3)]
                           for t in range(plen, len(loop) - 1)])
    hyb, fill = lh.replay(loop, plen, oracle, "hybrid", 3), lh.replay(loop, plen, oracle, "hybrid_fill", 3)
    first = next(i for i, (x, y) in enumerate(zip(hyb, fill)) if x != y)
    assert (hyb[first], fill[first]) == (2, 3)


def test_datastore_lookup_rules():
    """The corpus n-gram tables: `first` copies what followed an n-gram's first occurrence, `walk` follows the most
    frequent next token (backing off to shorter n-grams), a longer match wins, and no match proposes nothing; from
    the same anchor the best-of-three round accepts at least what each single rule's round does."""
    sys.path.insert(0, str(ROOT / "examples"))
    import datastore_lookup_offline as dl

    docs = [[1, 2, 3, 4, 5, 6], [9, 2, 3, 4, 7, 7], [0, 2, 3, 4, 7, 8]]
    store = dl.Datastore(docs, max_ngram=4, min_ngram=3)
    assert store.propose([8, 2, 3, 4], 2, "first") == ([5, 6], 3)  # (2, 3, 4) first seen in doc 0
    # 7 follows (2, 3, 4) twice and 5 once; then (2, 3, 4, 7) is followed by 7 and by 8 once each (the first seen
    # wins the tie); (3, 4, 7, 7) and (4, 7, 7) end a document, so the walk stops short of the 3 tokens asked
    assert store.propose([8, 2, 3, 4], 3, "walk") == ([7, 7], 3)
    assert store.propose([9, 2, 3, 4], 2, "first") == ([7, 7], 4)  # the 4-gram (9, 2, 3, 4) wins
    assert store.propose([5, 5, 5], 2, "first") == ([], 0)
    tokens = [1, 2] + [2, 3, 4, 7, 7, 8, 2, 3, 4, 7, 7]
    props = torch.zeros(len(tokens) - 1 - 2, 3, dtype=torch.long)
    rounds = dl.replay_rules(tokens, 2, props, store)
    for rule in ("drafter", "hybrid", "hybrid_ds_first", "hybrid_ds_walk"):
        assert rounds["best_of_3"][0] >= rounds[rule][0]  # first round: the same anchor for every rule
    assert len(rounds["hybrid_ds_walk"]) < len(rounds["drafter"])  # the corpus continuation is accepted sometimes


def test_replay_diff_finds_where_runs_part():
    """trainer/gpu_replay_diff.py's recording and comparison: the hook sees every round, identical runs compare equal
    throughout, and two seeds part at round 0 in their uniforms, then in their tokens."""
    sys.path.insert(0, str(ROOT / "trainer"))
    from conftest import build_target
    from gpu_replay_diff import compare, record

    from hf_carryover.engine.engine import SpeculativeEngine

    target = build_target("llama")
    engine = SpeculativeEngine(target, build_drafter(target, "dflash", True), max_len=96)
    prompt = [[5, 9, 13, 7, 5, 9, 13, 7, 5, 9]]
    kw = dict(max_new_tokens=20, do_sample=True, prompt_lookup_num_tokens=4)
    a = record(engine, prompt, seed=1, **kw)
    (st,) = engine._states.values()
    assert engine.round_hook is None and len(a[1]) == int(st.round) >= len(engine.rounds[0]) > 1
    b, c = record(engine, prompt, seed=1, **kw), record(engine, prompt, seed=2, **kw)
    same = compare(a, b)
    assert same["same_tokens"] and same["first_token_round"] is None and same["first_carry_round"] is None
    assert same["max_carry_diff_before_parting"] == 0.0 and same["first_fwd_target_round"] is None
    other = compare(a, c)
    assert other["first_noise_round"] == 0
    assert not other["same_tokens"] and other["first_token_round"] is not None and "parting" in other
    assert other["first_fwd_block_round"] is not None and "first_forward_diff" in other


def test_attention_bench_variants_compute_the_same_attention(tmp_path):
    """trainer/gpu_attention_bench.py (eager, CPU): every way of calling one layer's attention, the window over the
    first keys included, gives the float64 reference's result at batch 1 and 3, and windows too short for the mask
    are skipped."""
    sys.path.insert(0, str(ROOT / "trainer"))
    import gpu_attention_bench

    out = tmp_path / "attn.json"
    res = gpu_attention_bench.main(["--device", "cpu", "--dtype", "float32", "--keys", "128", "--queries", "1", "4",
                                    "--valid", "40", "--variants", "hf", "hf_math", "gqa", "flex", "window64",
                                    "window32", "--layers", "2", "--replays", "1", "--no_compile", "--batch", "1", "3",
                                    "--out", str(out)])
    rows = res["rows"]
    assert json.loads(out.read_text())["rows"] == rows
    assert {(r["variant"], r["q_rows"], r["batch"]) for r in rows} == {
        (v, q, b) for v in ("hf", "hf_math", "gqa", "flex", "window64") for q in (1, 4) for b in (1, 3)}
    assert all("error" not in r and r["max_abs_err"] < 1e-5 and r["us_per_layer"] > 0 for r in rows), rows


def test_host_overhead_times_the_decoding_wrapper(tmp_path):
    """examples/host_overhead.py: times `_decoding` on a SmolLM2-shaped module tree with the models in eval mode and
    in training mode, and writes what it printed."""
    sys.path.insert(0, str(ROOT / "examples"))
    import host_overhead

    out = tmp_path / "host.json"
    res = host_overhead.main(["--calls", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == res
    assert res["modules"] == [397, 51]
    assert all(res[k] > 0 for k in ("decoding_wrapper_ms", "decoding_wrapper_training_ms", "attention_switch_ms"))


def test_data_stats_valid_row_share(tmp_path):
    """examples/data_stats.py: the expected share of real proposal rows equals a hand count and the mean over many
    draws of the objectives' own `sample_anchors` + `block_targets`."""
    sys.path.insert(0, str(ROOT / "examples"))
    import data_stats
    from hf_carryover.training.objectives import block_targets, sample_anchors

    # prompt 2, sequence 6: anchors t = 2, 3, 4 with 3, 2, 1 valid proposals (P = 3)
    assert data_stats.valid_row_share(2, 6, 2, 3) == pytest.approx(2 * 2)  # 2 of 3 anchors, 2 rows each on average
    assert data_stats.valid_row_share(2, 6, 4, 3) == pytest.approx(6)  # all 3 anchors (one padded slot)
    assert data_stats.valid_row_share(5, 6, 4, 3) == 0.0  # no anchor has a next token
    g = torch.Generator().manual_seed(0)
    plen, slen = torch.tensor([3, 2]), torch.tensor([20, 9])
    draws = []
    for _ in range(400):
        anchors, a_ok = sample_anchors(plen, slen, 8, g)
        _, ok, _, _ = block_targets(torch.zeros(2, 20, dtype=torch.long), slen, anchors, a_ok, 5)
        draws.append(ok.sum(dim=(1, 2)).float())
    mean = torch.stack(draws).mean(0)
    for i in range(2):
        assert float(mean[i]) == pytest.approx(data_stats.valid_row_share(int(plen[i]), int(slen[i]), 8, 5), rel=0.02)
    shard = tmp_path / "set" / "shard-00000.jsonl"
    shard.parent.mkdir()
    shard.write_text("".join(json.dumps({"id": str(i), "prompt_len": 2, "input_ids": list(range(2 + n))}) + "\n"
                             for i, n in enumerate([4, 256, 256])))
    out = tmp_path / "stats.json"
    data_stats.main(["--data", str(shard.parent), "--anchors", "2", "--block_size", "4", "--out", str(out)])
    s = json.loads(out.read_text())["sets"][str(shard.parent)]
    assert s["responses"] == 3 and s["response_tokens"] == 516 and s["share_at_cap_256"] == pytest.approx(2 / 3)
    # the 4-token response: anchors 2..4 with 3/2/1 rows (mean 2), 2 anchors -> 4 of 6; a 256-token one: 255 anchor
    # positions, the last two with 2 and 1 rows -> 2 * (253 * 3 + 3) / 255 of 6
    long = 2 * (253 * 3 + 3) / 255
    assert s["valid_row_share"]["2"] == pytest.approx((4 + 2 * long) / 18)


def test_profile_engine_kernel_kinds_and_cpu_refusal():
    """`profile_engine.py` sorts kernels by kind from their names (names as the H200 profile of 2026-12-02 reported
    them), `host_profile` finds where a call's time went, and on a machine without CUDA the script stops with a
    message that says why instead of timing eager rounds."""
    sys.path.insert(0, str(ROOT / "examples"))
    from profile_engine import host_profile, kernel_kind

    kinds = {"nvjet_sm90_tst_64x8_64x16_2x4_h_bz_TNT": "gemm",
             "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64": "attention",
             "triton_poi_fused__unsafe_view_mul_silu_6": "triton",
             "void at::native::_scatter_gather_elementwise_kernel<128, 8>": "index",
             "Memset (Unknown)": "copy",
             "void at::native::mbtopk::computeBlockDigitCounts<float, unsigned int>": "other"}
    assert {n: kernel_kind(n) for n in kinds} == kinds

    def call():  # host_profile: one call's wall time, and where it went by function
        time.sleep(0.02)
        sum(range(1000))

    prof = host_profile(call, top=5, top_self=3)
    assert prof["call_ms"] >= 20 and len(prof["by_cumulative"]) <= 5 and len(prof["by_self"]) <= 3
    sleep = [r for r in prof["by_self"] if "sleep" in r["function"]]
    assert sleep and sleep[0]["calls"] == 1 and sleep[0]["self_ms"] >= 19
    assert prof["by_cumulative"][0]["cum_ms"] >= prof["by_cumulative"][-1]["cum_ms"]
    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without CUDA")
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "profile_engine.py"), "--out", "x.json"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode != 0 and "needs a GPU" in run.stderr


def test_profile_engine_counts_a_batchs_rounds_and_tokens(monkeypatch):
    """`profile_engine.profile_mode` with --batch 2 on CPU (engines eager: no CUDA graphs or compile here, the GPU
    figures absent): tokens are every row's, τ is the engines' own over all rows, a round of the batch is counted once
    (its longest row), and the batch-1 prefill timing is skipped; at batch 1 rounds and row rounds agree."""
    from argparse import Namespace

    from conftest import build_target
    from profile_engine import profile_mode

    import hf_carryover.engine.engine as engine_mod

    real = engine_mod.SpeculativeEngine
    monkeypatch.setattr(engine_mod, "SpeculativeEngine",
                        lambda *a, **kw: real(*a, **{**kw, "cuda_graphs": False, "compile": False}))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    target = build_target("llama", seed=2)
    drafter = build_drafter(target, "dflash", True)
    prompts = [[3, 5, 7, 9, 11], [2, 4, 6], [8, 10, 12, 14, 16, 18], [1, 3, 1, 3]]
    args = Namespace(max_new_tokens=12, compile_options={}, engine_kw={}, tree_nodes=None, replays=2,
                     profile_replays=1, batch=2)
    saved = []
    res = profile_mode(args, target, drafter, prompts, None, "linear", saved.append)
    ref = real(target, drafter, max_len=64)
    outs, rounds, batch_rounds = [], [], 0
    for batch in (prompts[:2], prompts[2:]):
        outs += ref.generate(batch, max_new_tokens=12)
        rounds += [a for r in ref.rounds for a in r]
        batch_rounds += max(len(r) for r in ref.rounds)
    assert res["tokens"] == sum(len(o) for o in outs) == 4 * 12
    assert res["batch"] == 2 and res["prefill_ms"] is None and "gpu_ms" not in res and saved[-1] is res
    assert (res["rounds"], res["batch_rounds"]) == (len(rounds), batch_rounds) and batch_rounds < len(rounds)
    assert res["tau"] == (sum(rounds) + len(rounds)) / len(rounds)
    per_batch = res["generate_ms_per_round"]
    args.batch = 1
    one = profile_mode(args, target, drafter, prompts, None, "linear", saved.append)
    assert one["rounds"] == one["batch_rounds"] == len(rounds) and one["prefill_ms"] is not None
    assert per_batch > 0 and one["generate_ms_per_round"] > 0


def test_evaluate_tau_specs_and_held_out_prompts(tmp_path):
    """Spec values: booleans and numbers as JSON reads them (`lookup_confidence=0.9` a float, not the string), paths
    as given; `--skip N` leaves out the first N prompts (tuning on prompts the benchmarks do not use)."""
    sys.path.insert(0, str(ROOT / "examples"))
    from evaluate_tau import load_prompts, parse_spec

    name, path, over, lookup = parse_spec("c9=model_cards/x-1,tree=t.json,tree_nodes=31,lookup=15,"
                                          "lookup_confidence=0.9,lookup_siblings=false")
    assert (name, path, lookup) == ("c9", "model_cards/x-1", 15)
    assert over == {"tree": "t.json", "tree_nodes": 31, "lookup_confidence": 0.9, "lookup_siblings": False}
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"id": i, "input_ids": [i]}) + "\n" for i in range(5)))
    assert [r["id"] for r in load_prompts(tmp_path, "d", 2, skip=3)] == [3, 4]
    assert [r["id"] for r in load_prompts(tmp_path, "d", 0)] == [0, 1, 2, 3, 4]


def test_compile_census_counts_graphs_and_breaks(tmp_path):
    """examples/compile_census.py: per mode, the graphs Dynamo traced (row prefill and round) and its breaks by reason,
    written with the command and environment; a sampled tree round breaks on purpose around `sampling.running_mass`
    (`torch.compiler.disable`) and before its K/V move."""
    sys.path.insert(0, str(ROOT / "examples"))
    import compile_census

    out = tmp_path / "census.json"
    res = compile_census.main(["--modes", "ar", "tree_sampled", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == res["rows"] and res["env"]["torch"]
    ar, sampled = res["rows"]
    assert (ar["graphs"], ar["breaks"]) == (3, 0), ar  # the row prefill's forward and copy-in, the round
    # ... and once more between its verify and its K/V move (`_tree_round`: each graph writes a cache once, in place)
    assert sampled["breaks"] >= 2 and all("disable" in r or "graph_break()" in r for r in sampled["reasons"]), sampled
    assert any("graph_break()" in r for r in sampled["reasons"]), sampled


_CENSUS_PROBE = """
import sys
import torch
import kernel_census as kc

kc._codegen_only()
rule = sys.argv[1]
if rule == "cpu":  # inductor's own CPU rule back (what the census counted with before 2026-12-05e)
    import torch._inductor.ir as ir
    ir.StorageBox.should_realize_on_reuse = kc._CPU_RULE
k, n = 48, 16
w_gu, w_down = torch.randn(n, 2 * k), torch.randn(k, n)

def step(h):  # a one-row MLP as gemv_rows writes it: gate/up as a reduction, SiLU(gate) * up, down as a reduction
    gu = (h[:, :, None] * w_gu[None]).sum(1)
    act = torch.nn.functional.silu(gu[:, :k]) * gu[:, k:]
    return (act[:, :, None] * w_down[None]).sum(1)

with kc.written_code() as paths:
    torch.compile(step)(torch.randn(1, n))
launches, _ = kc.count_launches(paths)
print(dict(launches))
"""


def test_kernel_census_counts_with_the_gpus_realization_rules(tmp_path):
    """examples/kernel_census.py generates code as inductor does for a GPU: SiLU(gate) * up, read once per output
    column by the down projection's reduction, is recomputed inside it (two reductions, no pointwise kernel), where
    inductor's CPU rule for values with a sigmoid would write it out (a third kernel: what the census counted before).
    Both runs share an inductor cache directory: the census reads no cached code, whose keys do not cover these rules.
    A process of its own: the census switches inductor's CPU backend to Triton code generation for the process."""
    pytest.importorskip("triton")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "examples"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind"),
           "OMP_NUM_THREADS": "1"}  # (one cache directory for both runs: the census must not read it)
    got = {}
    for rule in ("gpu", "cpu"):
        res = subprocess.run([sys.executable, "-c", _CENSUS_PROBE, rule], env=env, capture_output=True, text=True,
                             cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-2000:]
        got[rule] = eval(res.stdout.strip().splitlines()[-1])  # noqa: S307  (a dict the probe printed)
    assert got["gpu"] == {"triton_per": 2}, got
    assert got["cpu"] == {"triton_per": 2, "triton_poi": 1}, got  # the negative control: the old count


_PDL_PROBE = """
import re
import sys
import torch
import kernel_census as kc
import torch._inductor.codegen.triton as tri

kc._codegen_only()
if not hasattr(tri.TritonKernel, "_enable_pdl_codegen"):
    print("no PDL in this inductor")
    raise SystemExit(0)
tri.TritonKernel._enable_pdl_codegen = staticmethod(lambda: True)  # inductor's PDL code, as for a Hopper GPU
from conftest import build_target
from hf_carryover.engine.engine import SpeculativeEngine

options = {"freezing": True, **({"triton.enable_pdl": True} if sys.argv[1] == "pdl" else {})}
engine = SpeculativeEngine(build_target("llama", seed=3, num_layers=2), None, max_len=64, compile=True,
                           compile_options=options, gemv_rows=1)
engine.row_prefill = False

def stop(st):
    raise kc._Stop

engine.round_hook = stop
with kc.written_code() as paths:
    try:
        with torch.no_grad():
            engine.generate([[3, 7, 11, 5]], max_new_tokens=4)
    except kc._Stop:
        pass
# one-row GEMV kernels (reductions with loads indexed by output column and input width: the weight's) by where their
# wait is: before every load ("entry": inductor's choice after a kernel it did not generate, e.g. attention), after all
# weight loads ("before"), or between ("after")
entry = before = after = 0
for path in paths:
    for src in re.split(r"@triton\\.jit", open(path).read())[1:]:
        lines = src.splitlines()
        waits = [i for i, l in enumerate(lines) if "gdc_wait" in l]
        loads = [i for i, l in enumerate(lines) if "tl.load(" in l]
        weights = [i for i in loads if "r0_" in lines[i] and re.search(r"\\bx\\d", lines[i])]
        if "tl.sum" in src and waits and weights:
            entry += waits[0] < loads[0]
            before += loads[0] < waits[0] and max(weights) < waits[0]
            after += loads[0] < waits[0] < max(weights)
print({"entry": entry, "before": before, "after": after, "weights_first": engine.fused_projections.weights_first})
"""


def test_gemv_weights_load_ahead_of_the_pdl_wait(tmp_path):
    """With inductor's programmatic dependent launch (`triton.enable_pdl`) the GEMV rewrite puts the weight first in
    each product, so in the generated one-row GEMVs the weight's loads come before the kernel's wait on the kernel
    ahead of it: they can overlap it. Inductor waits before every load after a kernel it did not generate (here
    attention, ahead of each o_proj); those are left as they are. Without the option (the negative control: the same
    PDL code generation, forced on for this CPU) the input comes first, and weight loads come after the wait. Code
    generation only, as in examples/kernel_census.py; the order changes no number (the products commute exactly)."""
    pytest.importorskip("triton")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (ROOT / "examples", ROOT / "tests", ROOT)),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind"), "OMP_NUM_THREADS": "1"}
    got = {}
    for mode in ("pdl", "plain"):
        res = subprocess.run([sys.executable, "-c", _PDL_PROBE, mode], env=env, capture_output=True, text=True,
                             cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-2000:]
        last = res.stdout.strip().splitlines()[-1]
        if last == "no PDL in this inductor":
            pytest.skip(last)
        got[mode] = eval(last)  # noqa: S307  (a dict the probe printed)
    layers = 2
    assert got["pdl"]["weights_first"] and not got["plain"]["weights_first"]
    assert got["pdl"]["before"] >= 3 * layers and got["pdl"]["after"] == 0, got  # q/k/v, gate/up, down a layer
    assert got["pdl"]["entry"] == layers, got  # each o_proj, after attention
    assert got["plain"]["after"] > 0 and got["plain"]["before"] == 0, got  # (a GEMV whose input loads first waits
    # at entry, where that input is what the kernel ahead wrote)


def test_pass_determinism_flags_rows_whose_passes_decoded_different_tokens(tmp_path, capsys):
    """examples/pass_determinism.py: a row timed in several passes is flagged when their token counts differ; rows of
    one pass and rows without a pass field are left out; passes are compared per file, method and dataset."""
    sys.path.insert(0, str(ROOT / "examples"))
    import pass_determinism

    raw = tmp_path / "bench_raw.jsonl"
    rows = [("engine_ar@1", "mt", 0, 100), ("engine_ar@1", "mt", 1, 97), ("engine_tree_lookup31:x@1", "mt", 0, 90),
            ("engine_tree_lookup31:x@1", "mt", 1, 90), ("engine_ar@1", "he", 0, 50), ("hf_eager", "mt", 0, 80)]
    sampled = [("engine_tree_lookup31:x@1", "mt", 0, 70), ("engine_tree_lookup31:x@1", "mt", 1, 70)]  # T=1: apart
    raw.write_text("".join(json.dumps({"method": m, "dataset": d, "pass": p, "tokens": t}) + "\n"
                           for m, d, p, t in rows)
                   + "".join(json.dumps({"method": m, "dataset": d, "pass": p, "tokens": t, "temperature": 1.0}) + "\n"
                             for m, d, p, t in sampled)
                   + json.dumps({"method": "engine_ar@1", "dataset": "mt", "tokens": 1}) + "\n")
    summary = pass_determinism.main([str(raw)])
    assert summary == {"engine_ar": (1, 1), "engine_tree_lookup31": (2, 0)}
    assert "tokens per pass [100, 97]" in capsys.readouterr().out


def test_compare_trees_counts_shared_nodes_and_bounds_the_other_tree(tmp_path, capsys):
    """examples/compare_trees.py: the other tree's expected tokens a round come from the calibrated counts, a path
    the calibrated superset lacks counts as never accepted (and is reported), shared nodes are per tree size."""
    sys.path.insert(0, str(ROOT / "examples"))
    from compare_trees import compare, main

    calibrated = {"paths": [[0], [0, 0], [1], [0, 1]], "counts": [60, 30, 20, 10], "anchors": 100}
    other = {"paths": [[0], [1], [2], [1, 0]], "counts": [9, 8, 7, 6], "anchors": 50}
    rows = compare(calibrated, other, sizes=(1, 2, 3, 4, 5))
    assert set(rows) == {1, 2, 3, 4}  # 5 is beyond both trees
    assert rows[2] == {"shared": 1, "calibrated": 1.9, "other_lower_bound": 1.8, "other_without_count": 0}
    assert rows[4]["shared"] == 2 and rows[4]["other_without_count"] == 2 and rows[4]["other_lower_bound"] == 1.8
    assert rows[4]["calibrated"] == pytest.approx(2.2)
    (tmp_path / "a.json").write_text(json.dumps(calibrated))
    (tmp_path / "b.json").write_text(json.dumps(other))
    main(["--calibrated", str(tmp_path / "a.json"), "--other", str(tmp_path / "b.json"), "--sizes", "3", "4",
          "--out", str(tmp_path / "c.json")])
    assert "| 3 | 2 | 2.1000 | 1.8000 | 1 |" in capsys.readouterr().out
    assert json.loads((tmp_path / "c.json").read_text())["rows"]["4"]["shared"] == 2


def test_environment_marks_a_tree_that_differs_from_its_commit(tmp_path, monkeypatch):
    """Results record the commit they were measured at; a tree with tracked changes is not that commit, so its
    commit reads "<HEAD>-dirty" (a copy whose .git is stale, as on the GPU machine, shows up the same way), and
    HF_CARRYOVER_COMMIT (what the device pipeline sets) wins over git."""
    sys.path.insert(0, str(ROOT / "examples"))
    from evaluate_tau import environment

    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    (tmp_path / "code.py").write_text("x = 1\n")
    for cmd in (["init", "-q"], ["add", "code.py"], ["commit", "-qm", "one"]):
        subprocess.run(git + cmd, cwd=tmp_path, check=True, capture_output=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_CARRYOVER_COMMIT", raising=False)
    (tmp_path / "notes.txt").write_text("untracked files do not count\n")
    assert environment()["commit"] == head
    (tmp_path / "code.py").write_text("x = 2\n")
    assert environment()["commit"] == head + "-dirty"
    monkeypatch.setenv("HF_CARRYOVER_COMMIT", "f" * 40)
    assert environment()["commit"] == "f" * 40
    monkeypatch.delenv("HF_CARRYOVER_COMMIT")
    monkeypatch.chdir(tmp_path.parent)  # no repository: no commit
    if subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        assert environment()["commit"] is None


def test_quickstart_refuses_a_missing_drafter_folder(tmp_path):
    """README command 1's `--drafter`: a path that holds no drafter is refused by name before the target loads; a Hub
    repo id ("namespace/name") and a saved folder pass through."""
    sys.path.insert(0, str(ROOT / "examples"))
    from quickstart import find_drafter

    for bad in (str(tmp_path / "nope"), "./nope", "a/b/c", str(tmp_path)):
        with pytest.raises(SystemExit, match="no drafter folder there"):
            find_drafter(bad)
    assert find_drafter("someone/some-drafter") == Path("someone/some-drafter")
    (tmp_path / "config.json").write_text("{}")
    assert find_drafter(str(tmp_path)) == tmp_path


def test_draw_boundary_names_the_mass_between_two_parted_draws():
    """gpu_engine_check's diagnosis of two sampled runs that part: the target's distribution after the common prefix,
    the two tokens' probabilities and the mass between them in vocabulary order (zero for neighbours across one
    boundary of the inverse CDF, which is what a rounding change can move a draw across)."""
    sys.path.insert(0, str(ROOT / "trainer"))
    from conftest import build_target
    from gpu_engine_check import draw_boundary

    target = build_target()
    prompts = [[3, 4], [5, 6, 7]]
    ref = [[8, 9, 10], [11, 12, 13, 14]]
    with torch.no_grad():
        probs = target(torch.tensor([[5, 6, 7, 11, 12]])).logits[0, -1].float().softmax(-1)
    for other, between in ((14, 0.0), (17, probs[14:17].sum().item()), (10, probs[11:13].sum().item())):
        out = [ref[0], [11, 12, other, 1]]
        got = draw_boundary(target, prompts, ref, out)
        assert got["at"] == [1, 2] and got["tokens"] == [13, other]
        assert got["p"] == pytest.approx([probs[13].item(), probs[other].item()], rel=1e-5)
        assert got["mass_between"] == pytest.approx(between, abs=1e-7)
        assert got["cdf_at_boundary"] == pytest.approx(probs[:min(13, other) + 1].sum().item(), rel=1e-5)
    assert draw_boundary(target, prompts, ref, [list(x) for x in ref]) is None  # equal runs
    assert draw_boundary(target, prompts, ref, [ref[0], ref[1][:2]]) is None  # one run ended first


def test_fused_linear_ncu_launches_each_form_once_and_checks_them():
    """`examples/fused_linear_ncu.py` (the forms of `fused_linear`'s tiled kernel for Nsight Compute) on the CPU in
    Triton's interpreter: every form of both shapes runs, agrees with the eager modules and is launched in the
    printed order."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "fused_linear_ncu.py"), "--device", "cpu",
                          "--rows", "3"], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    labels = [line for line in res.stdout.splitlines() if "/" in line]
    assert labels == [f"{s}/{f}" for s in ("qkv", "gate_up") for f in ("cublas", "bare", "fold")], res.stdout
