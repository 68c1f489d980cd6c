"""Tests of the example scripts that turn benchmark results into tables and plots (results tables, plot_speed.py,
round_cost.py, batch_fill.py) on tiny hand-made result files whose numbers the tests count by hand."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import build_drafter

ROOT = Path(__file__).resolve().parents[1]


def test_results_tables_gain_against_own_baseline(tmp_path):
    """The README's τ table: each Carryover row shows its gain over the baseline of the same drafter type."""
    sys.path.insert(0, str(ROOT / "examples"))
    from results_tables import tau_table

    res = {}
    for name, taus in {"x-baseline": (2.0, 1.5), "x-carryover": (2.2, 1.5)}.items():
        for ds, tau in zip(("a", "b"), taus):
            res[f"{name}|{ds}"] = {"drafter": name, "dataset": ds, "temperature": 0.0, "tau": tau, "prompts": 3}
    (tmp_path / "s.json").write_text(json.dumps({"results": res}))
    table = tau_table([tmp_path / "s.json"])
    assert "| x-carryover | 2.200 (+10.0%) | 1.500 (+0.0%) | 1.850 (+5.7%) |" in table
    assert "| x-baseline | 2.000 | 1.500 | 1.750 |" in table
    # --baseline: every drafter against a named one; a drafter with no T=1 rows is not in the T=1 table
    res["v|a|1"] = {"drafter": "x-baseline", "dataset": "a", "temperature": 1.0, "tau": 1.2, "prompts": 3}
    (tmp_path / "s.json").write_text(json.dumps({"results": res}))
    table = tau_table([tmp_path / "s.json"], baseline="x-carryover")
    assert "| x-baseline | 2.000 (-9.1%) | 1.500 (+0.0%) | 1.750 (-5.4%) |" in table
    t1 = table[table.index("**T = 1**"):]
    assert "x-carryover" not in t1 and "| x-baseline | 1.200 | – | 1.200 |" in t1
    # a Carryover run cut by its time box (no "b" rows): gains on the shared dataset only, and the mean's gain says so
    res = {k: v for k, v in res.items() if k != "x-carryover|b"}
    (tmp_path / "s.json").write_text(json.dumps({"results": res}))
    assert "| x-carryover | 2.200 (+10.0%) | – | 2.200 (+10.0% over a) |" in tau_table([tmp_path / "s.json"])


def test_plot_speed_draws_summary_rows_first_file_first(tmp_path):
    """plot_speed.py draws each method's summary row (the median of --passes, not the passes behind it); a method in
    two files is drawn from the first file named; a folder's re-run counts its last summary row; batch sizes and
    method kinds come from the names; a file without summary rows is refused by name."""
    sys.path.insert(0, str(ROOT / "examples"))
    from plot_speed import ar_of, batch_of, kind_of, select_rows

    assert [batch_of(m) for m in ("engine_ar@8", "engine_ar@8c", "hf_static_compile", "engine_tree_lookup31:d@1")] \
        == [8, 8, 1, 1]
    # a ratio's AR row keeps the batching: continuous rows against continuous AR (the batch-8 labels were missing)
    assert [ar_of(m) for m in ("engine_tree_lookup31:d@8c", "engine_tree_lookup31:d@8", "hf_static_compile")] \
        == ["engine_ar@8c", "engine_ar@8", "engine_ar@1"]
    assert kind_of("engine_tree_lookup31:dflash-carryover-gated@8") == "engine_tree_lookup"
    assert kind_of("engine_lookup:d@1") == "engine_lookup" and kind_of("vllm_ar@8") == "vllm_ar"

    def row(method, tps, **kw):
        return json.dumps({"method": method, "dataset": "mtbench", "temperature": 0.0, "tok_per_s": tps, **kw}) + "\n"

    a, b = tmp_path / "a" / "bench_raw.jsonl", tmp_path / "b" / "bench_raw.jsonl"
    a.parent.mkdir()
    b.parent.mkdir()
    a.write_text(row("engine_ar@1", 690.0, **{"pass": 0}) + row("engine_ar@1", 700.0) + row("vllm_ar@1", 370.0)
                 + row("engine_ar@1", 710.0))  # the last line: this folder's re-run
    b.write_text(row("engine_ar@1", 650.0) + row("hf_static_compile", 260.0))
    rows, skipped = select_rows([a, b])
    got = {r["method"]: r["tok_per_s"] for r in rows}
    assert got == {"engine_ar@1": 710.0, "vllm_ar@1": 370.0, "hf_static_compile": 260.0}
    assert len(skipped) == 1 and str(b) in skipped[0] and "engine_ar@1" in skipped[0]
    rows, _ = select_rows([b, a])  # order decides which file's engine AR is drawn
    assert {r["method"]: r["tok_per_s"] for r in rows}["engine_ar@1"] == 650.0
    assert {r["method"] for r in select_rows([a, b], methods=["vllm_ar", "hf_static_compile"])[0]} \
        == {"vllm_ar@1", "hf_static_compile"}
    trees = tmp_path / "trees.jsonl"  # one drafter setting of several, by its name without the batch suffix
    trees.write_text(row("engine_tree_lookup31:new@1", 2400.0) + row("engine_tree_lookup31:g16@1", 1600.0))
    assert {r["method"] for r in select_rows([trees], methods=["engine_tree_lookup31:new"])[0]} \
        == {"engine_tree_lookup31:new@1"}
    assert len(select_rows([trees], methods=["engine_tree_lookup"])[0]) == 2
    only_passes = tmp_path / "cut.jsonl"
    only_passes.write_text(row("engine_ar@1", 690.0, **{"pass": 0}))
    with pytest.raises(SystemExit, match="No summary rows"):
        select_rows([only_passes])
    pytest.importorskip("matplotlib")  # the [train] extra; the rest draws the PNG
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "plot_speed.py"), str(a), str(b), "--out",
                          str(tmp_path / "speed.png")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "speed.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "not drawn" in res.stdout


def test_round_cost_splits_a_speed_ratio_into_tau_and_round_cost(tmp_path, capsys):
    """examples/round_cost.py: ms a verification = seconds / (tokens / τ) (a step for plain decoding), and a pair's
    speed ratio is exactly its τ factor times its round factor; method names holding ':' parse as pairs."""
    sys.path.insert(0, str(ROOT / "examples"))
    import round_cost

    rows = [{"method": "engine_ar@1", "dataset": "d", "tokens": 1000, "seconds": 1.0, "tok_per_s": 1000.0, "tau": None},
            {"method": "engine_tree_lookup31:new@1", "dataset": "d", "tokens": 900, "seconds": 0.4, "tok_per_s": 2250.0,
             "tau": 3.6},
            {"method": "engine_tree_lookup31:old@1", "dataset": "d", "tokens": 1000, "seconds": 0.56,
             "tok_per_s": 1000 / 0.56, "tau": 3.2},
            {"method": "engine_tree_lookup31:old@1", "dataset": "e", "error": "OOM"}]
    raw = tmp_path / "bench_raw.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = round_cost.load_rows([raw])
    assert len(loaded) == 3  # the failed row is skipped
    new = loaded[1]
    assert new["verifications"] == pytest.approx(250.0) and new["ms_per_verification"] == pytest.approx(1.6)
    assert loaded[0]["ms_per_verification"] == pytest.approx(1.0)  # plain decoding: a step a token
    split = round_cost.split_ratio(new, loaded[2])
    assert split["speed"] == pytest.approx(split["tau"] * split["round"])
    assert split["tau"] == pytest.approx(3.6 / 3.2) and split["round"] == pytest.approx(1.792 / 1.6)
    pair = round_cost.parse_pair("engine_tree_lookup31:new@1:engine_tree_lookup31:old@1")
    assert pair == ("engine_tree_lookup31:new@1", "engine_tree_lookup31:old@1")
    with pytest.raises(ValueError, match="METHOD@B:METHOD@B"):
        round_cost.parse_pair("engine_ar")
    text = round_cost.main([str(raw), "--pair", "engine_tree_lookup31:new@1:engine_tree_lookup31:old@1",
                            "--out", str(tmp_path / "t.md")])
    assert ("| 0 | d | engine_tree_lookup31:new@1 | engine_tree_lookup31:old@1 | 1.260 | 1.125 | 1.120 | – | – | – |"
            in text)
    assert (tmp_path / "t.md").read_text() == text
    # one method in two files (two calls that differ in a global flag): paired only when each side names its file
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({**rows[2], "method": "engine_tree_lookup31:new@1"}) + "\n")
    assert "| 1:0 |" not in round_cost.main([str(raw), str(other), "--pair",
                                             "engine_tree_lookup31:new@1:engine_tree_lookup31:new@1"])
    text = round_cost.main([str(raw), str(other), "--pair",
                            "0/engine_tree_lookup31:new@1:1/engine_tree_lookup31:new@1"])
    assert "| 0:1 | d | 0/engine_tree_lookup31:new@1 | 1/engine_tree_lookup31:new@1 | 1.260 | 1.125 | 1.120 |" in text
    with pytest.raises(ValueError, match="both sides"):
        round_cost.parse_pair("0/engine_ar@1:engine_ar@1")
    with pytest.raises(SystemExit):  # file 2 of two files
        round_cost.main([str(raw), str(other), "--pair", "0/engine_tree_lookup31:new@1:2/engine_tree_lookup31:new@1"])
    assert "names a file past the 2 given (numbered from 0)" in capsys.readouterr().err


def test_round_cost_counts_the_keys_plain_steps_attended_to(tmp_path):
    """round_cost.py --prompts_dir: a prompt of p tokens with an output of n tokens took n - 1 plain steps (the first
    token came from the prefill), step i attending to p + i keys; rows with τ (speculative) are left out."""
    sys.path.insert(0, str(ROOT / "examples"))
    import round_cost

    # prompts of 3 and 10 tokens, outputs of 4 and 2 tokens: steps attend to 4, 5, 6 and 11 keys
    assert round_cost.keys_in_use([3, 10], [4, 2]) == (pytest.approx(26 / 4), 11)
    with pytest.raises(ValueError, match="2 prompt lengths for 1 outputs"):
        round_cost.keys_in_use([3, 10], [4])
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "d.jsonl").write_text("".join(json.dumps({"input_ids": [1] * n}) + "\n" for n in (3, 10, 7)))
    rows = [{"method": "engine_ar@1", "dataset": "d", "tokens": 6, "seconds": 1.0, "tok_per_s": 6.0, "tau": None,
             "prompt_tokens": [4, 2]},
            {"method": "engine_tree_lookup31:new@1", "dataset": "d", "tokens": 6, "seconds": 0.5, "tok_per_s": 12.0,
             "tau": 2.0, "prompt_tokens": [4, 2]}]
    raw = tmp_path / "bench_raw.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = round_cost.main([str(raw), "--prompts_dir", str(prompts)])
    assert "| 0 | d | engine_ar@1 | 6 | 11 |" in text  # 6.5 keys on average (printed rounded), 11 at most
    assert text.count("engine_tree_lookup31:new@1") == 1  # in the cost table only


def test_round_cost_splits_a_batch_ratio_into_tokens_a_row_round_fill_and_round_cost(tmp_path):
    """Batch rows with launched rounds (`benchmark.run_engine`): the speed ratio is exactly the product of the tokens
    a row round factor, the fill factor and the launched-round factor."""
    sys.path.insert(0, str(ROOT / "examples"))
    import round_cost

    def row(method, tokens, seconds, tau, rows, launched, batch=8):
        return {"method": method, "dataset": "d", "tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds,
                "tau": tau, "launched_rounds": launched, "row_rounds": rows, "batch_fill": rows / (batch * launched),
                "ms_per_launched_round": 1000 * seconds / launched}
    raw = tmp_path / "bench_raw.jsonl"
    raw.write_text(json.dumps(row("engine_ar@8", 4096, 0.6, None, 4080, 512)) + "\n"
                   + json.dumps(row("engine_tree@8", 3900, 0.45, 3.4, 1140, 170)) + "\n")
    ar, tree = round_cost.load_rows([raw])
    split = round_cost.split_ratio(tree, ar)
    assert split["speed"] == pytest.approx(split["row_tokens"] * split["fill"] * split["launched"])
    assert split["fill"] == pytest.approx((1140 / 170) / (4080 / 512))
    assert split["launched"] == pytest.approx((600 / 512) / (450 / 170))
    text = round_cost.table([ar, tree], [("engine_tree@8", "engine_ar@8")])
    assert f"| {1140 / (8 * 170):.3f} | {450 / 170:.4f} |" in text


def test_batch_fill_replays_the_engines_batches_from_each_prompts_rounds(tmp_path):
    """examples/batch_fill.py: from the rounds each prompt's row decodes in alone (batch 1), the rounds the engine
    launches for static batches and for continuous batching of b rows are predicted exactly (run-ahead off), for
    plain decoding and for a drafter with lookup, with an EOS that ends some prompts early; benchmark rows record
    those rounds (`prompt_rounds`, including a last round with no room for a draft, which τ's log leaves out)."""
    sys.path.insert(0, str(ROOT / "examples"))
    import batch_fill
    from benchmark import run_engine
    from conftest import build_target
    from test_engine import _prompts

    from hf_carryover.engine.engine import SpeculativeEngine

    target = build_target("llama", seed=5)
    prompts = _prompts(7, (13, 3, 9, 1, 6, 11, 4))
    eos = SpeculativeEngine(target, None, max_len=64).generate(prompts[:1], max_new_tokens=12)[0][4]
    kw = dict(max_new_tokens=12, eos_token_id=eos)
    for drafter, lookup in ((None, None), (build_drafter(target, "dflash", True), 3)):
        engine = SpeculativeEngine(target, drafter, max_len=64, run_ahead=False)
        kw["prompt_lookup_num_tokens"] = lookup
        rounds = []
        for p in prompts:
            engine.generate([p], **kw)
            rounds.append(engine.last_launched)
        assert len(set(rounds)) > 1  # the EOS ended some prompts early
        for b in (2, 3):
            launched = 0
            for i in range(0, len(prompts), b):
                engine.generate(prompts[i : i + b], **kw)
                launched += engine.last_launched
            assert batch_fill.static_rounds(rounds, b) == launched
            engine.generate(prompts, batch_size=b, **kw)
            assert batch_fill.continuous_rounds(rounds, b) == engine.last_launched
            assert batch_fill.continuous_rounds(rounds, b) < batch_fill.static_rounds(rounds, b)
            # the run-ahead loop (the engine's default): a round more a call, a refilled row idles one round (the
            # drafter-skipping lookup variant keeps the blocking loop, so the drafter here drafts in every round)
            ahead = SpeculativeEngine(target, drafter, max_len=64, run_ahead=True, lookup_skips_drafter=False)
            ahead.generate(prompts, batch_size=b, **kw)
            assert batch_fill.continuous_rounds(rounds, b, run_ahead=True) == ahead.last_launched
            assert ahead.last_launched > batch_fill.continuous_rounds(rounds, b) + 1  # refills idled
            launched = 0
            for i in range(0, len(prompts), b):
                ahead.generate(prompts[i : i + b], **kw)
                launched += ahead.last_launched
            assert batch_fill.static_rounds(rounds, b, run_ahead=True) == launched
        row = run_engine(engine, prompts, 12, 3, eos, lookup=lookup)
        assert row["prompt_rounds"] == rounds and row["batch_fill"] == batch_fill.fill(rounds, 3, False)
    # the rows' rounds from τ's log and the output (`benchmark.occupied_rounds`) with a trained drafter, whose rounds
    # accept drafts, and EOS tokens that end rows inside an accepted block: every launched round is counted
    from benchmark import occupied_rounds
    from test_engine import _greedy_refs, _trained_setup

    target, drafter, prompts, max_new, _ = _trained_setup("dflash", True, steps=60)
    engine = SpeculativeEngine(target, drafter, max_len=96, run_ahead=False)
    accepted = 0
    for lookup in (None, 4):
        for at in (3, 8, 17):
            eos = _greedy_refs(target, prompts[:1], 20)[0][at]
            for p in prompts:
                out = engine.generate([p], max_new_tokens=max_new, eos_token_id=eos, prompt_lookup_num_tokens=lookup)
                assert occupied_rounds(engine.rounds[0], out[0]) == engine.last_launched
                accepted += sum(engine.rounds[0])
    assert accepted > 0
    raw = tmp_path / "bench_raw.jsonl"
    timed = {"dataset": "d", "tokens": 16, "seconds": 1.0, "tok_per_s": 16.0}  # what every benchmark row holds
    raw.write_text(json.dumps({"method": "m@1", "prompt_rounds": [4, 1, 1, 4], "tau": 1.6, **timed}) + "\n"
                   + json.dumps({"method": "ar@1", "prompt_rounds": [2, 2, 2, 2], **timed}) + "\n")
    text = batch_fill.main([str(raw), "--batch", "2", "--vs", "ar@1"])
    assert "| 0 | d | m@1 | 4 | 2 | 0.625 | 0.833 |" in text  # static: 10 / (2 x 8); continuous: 10 / (2 x 6)
    assert "| 0 | d | m@1 | 4 | 2 | 0.625 | 0.833 |\n" in text and "| 0 | d | ar@1 | 4 | 2 | 1.000 | 1.000 |" in text
    # --run_ahead: a refilled row idles a round, a call runs one more; a continuous row's own fill sits beside its
    # replay (`measured`) where the replay covers its prompts, batch size and batching
    raw.write_text(json.dumps({"method": "m@2c", "prompt_rounds": [4, 1, 1, 4], "launched_rounds": 9,
                               "row_rounds": 10, "batch_fill": 10 / 18, **timed}) + "\n")
    text = batch_fill.main([str(raw), "--batch", "2", "--run_ahead", "--prompts", "3", "4"])
    # continuous: the rows free after rounds 4 and 1; the third prompt idles a round and ends after 1 + 1 + 1 = 3,
    # the fourth takes that row, idles, ends after 3 + 1 + 4 = 8; one round more: 9; static: (4 + 1) + (4 + 1)
    assert f"| 0 | d | m@2c | 4 | 2 | {10 / 20:.3f} | {10 / 18:.3f} | {10 / 18:.3f} |" in text
    assert "| 0 | d | m@2c | 3 | 2 | " in text and text.count(" – |") == 1  # 3 prompts: no measured fill
