"""Smoke tests of the example and trainer scripts that decode through transformers (generate(), the engine on a
transformers target) on tiny in-process targets: plumbing only, numbers are meaningless. Their analysis helpers are
tested in test_script_tools.py; the training scripts in test_train_scripts.py.

Each script runs at least once here as a real subprocess (its command line, entry point and exit status); further runs
of the same script call its main() in this process with the same arguments (`_in_process`), which skips the ~6 s
interpreter start with torch and transformers of every run.
"""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import build_drafter, build_target

ROOT = Path(__file__).resolve().parents[1]


def _in_process(monkeypatch, script: Path, args, cwd):
    """What `python SCRIPT ARGS` does, run in this process: the script's main() with that sys.argv, in `cwd`."""
    monkeypatch.syspath_prepend(str(script.parent))  # undone after the test, as argv and cwd are
    module = importlib.import_module(script.stem)
    monkeypatch.setattr(sys, "argv", [str(script), *map(str, args)])
    monkeypatch.chdir(cwd)
    return module.main()


def test_benchmark_script_tiny(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "examples"))
    from benchmark import load_target

    target = load_target("tiny", torch.float32, "cpu")
    build_drafter(target, "dflash", True).save_pretrained(tmp_path / "drafter")
    from test_offline_tau import overfit

    prompts_ids = [[3 + i, 7, 11, 5] for i in range(3)]
    rollouts = [(4, target.generate(torch.tensor([q]), max_new_tokens=12, do_sample=False)[0].tolist(), None)
                for q in prompts_ids]
    overfit(build_drafter(target, "dflash", False), target, rollouts, steps=60).save_pretrained(tmp_path / "plain")
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "mtbench.jsonl").write_text("".join(json.dumps({"id": i, "input_ids": q}) + "\n"
                                                   for i, q in enumerate(prompts_ids)))
    tree = tmp_path / "tree.json"  # a small static tree: two ranks at depth 1, the rank-0 chain to the block's depth 3
    tree.write_text(json.dumps({"paths": [[0], [1], [0, 0], [1, 0], [0, 0, 0]]}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "examples" / "benchmark.py"), "--target", "tiny", "--drafters",
           f"m={tmp_path / 'drafter'}", f"p={tmp_path / 'plain'}", "--datasets", "mtbench", "--prompts_dir",
           str(prompts), "--limit", "3", "--max_new_tokens", "12", "--batch_sizes", "1", "3", "--profile",
           "--cuda_graphs", "--lookup", "4", "--tree", f"p={tree}", "--tree_nodes", "3", "all", "--out",
           str(tmp_path / "out")]
    subprocess.run(cmd, check=True, env=env, capture_output=True, cwd=tmp_path)
    summary = json.loads((tmp_path / "out" / "bench.json").read_text())
    methods = {r["method"] for r in summary["results"]}
    assert {"hf_eager", "hf_prompt_lookup", "hf_spec:m", "engine_ar@1", "engine_ar@3", "engine:m@1", "engine:m@3",
            "hf_own_dflash:m", "hf_spec_lookup:m", "engine_lookup:m@1", "engine_lookup:m@3", "engine_pld@1",
            "engine_tree3:p@1", "engine_treeall:p@3", "engine_tree_lookup3:p@1", "engine_tree_lookupall:p@3",
            "hf_spec_tree3:p", "hf_spec_tree_lookupall:p"} <= methods
    assert not any("_tree" in m and not m.endswith(("p@1", "p@3", ":p")) for m in methods)  # p's tree only
    assert all(r["tokens"] == 36 for r in summary["results"])  # 3 prompts x 12 tokens, eos never hit
    # each row's whole cost (warm-up and first-use build included) is at least its timed part
    assert all(r["row_wall_s"] >= round(r["seconds"], 1) - 0.1 for r in summary["results"]), summary["results"]
    by = {r["method"]: r for r in summary["results"]}
    # transformers' own DFlash loop records no rounds: its τ comes from counting target forwards, and for a
    # drafter without Carryover it must equal our loop's recorded τ (the two accept the same tokens per round)
    assert by["hf_spec:p"]["tau"] > 1.5  # the overfitted drafter accepts several tokens a round
    assert by["hf_own_dflash:p"]["tau"] == pytest.approx(by["hf_spec:p"]["tau"])
    # the engine's context lookup takes generate()'s rounds (fp32 on CPU), so the same τ
    assert by["engine_lookup:p@1"]["tau"] == pytest.approx(by["hf_spec_lookup:p"]["tau"])
    assert by["engine_pld@1"]["tau"] >= 1.0 and "lookup_round_share" in by["engine_pld@1"]
    # generate() with a draft tree runs the engine's tree rounds: the same τ as the engine row at batch 1
    for kind in ("tree3", "tree_lookup3", "treeall"):
        assert by[f"hf_spec_{kind}:p"]["tau"] == pytest.approx(by[f"engine_{kind}:p@1"]["tau"])
    assert by["hf_spec_tree3:p"]["mode"] == "tree on the engine (eager)"
    # skipping the drafter in looked-up rounds changes the cost of a round, never its outcome
    for b in (1, 3):
        skip, always = by[f"engine_lookup:p@{b}"], by[f"engine_lookup_always_draft:p@{b}"]
        assert skip["tau"] == always["tau"] and always["drafter_skipped_rounds"] == 0
    assert "| mtbench | engine:m@3 |" in (tmp_path / "out" / "bench.md").read_text()
    assert {r["mode"] for r in summary["results"] if r["method"].startswith("engine")} == {"eager (no CUDA)"}
    assert "cuda_graphs" not in summary["not_covered"]
    spec1 = next(r for r in summary["results"] if r["method"] == "engine:m@1")
    assert set(spec1["per_round_s"]) == {"draft", "verify", "other"} and spec1["predicted_speedup_vs_engine_ar"] > 0
    # T=1: every path runs sampled and records its temperature (ratios compare rows of one temperature only)
    cmd_t1 = cmd[:cmd.index("--profile")] + ["--methods", "hf_eager", "hf_spec", "engine_ar", "engine",
                                             "--temperature", "1", "--warmup", "all", "--out", str(tmp_path / "t1")]
    _in_process(monkeypatch, ROOT / "examples" / "benchmark.py", cmd_t1[2:], tmp_path)
    t1 = json.loads((tmp_path / "t1" / "bench.json").read_text())
    assert t1["temperature"] == 1.0 and {r["temperature"] for r in t1["results"]} == {1.0} and t1["warmup"] == "all"
    assert {r["method"] for r in t1["results"]} == {"hf_eager", "hf_spec:m", "hf_spec:p", "engine_ar@1", "engine_ar@3",
                                                   "engine:m@1", "engine:m@3", "engine:p@1", "engine:p@3"}
    assert all(0 < r["tokens"] <= 36 for r in t1["results"])
    assert all(r["tau"] >= 1 for r in t1["results"] if r["method"].startswith(("hf_spec", "engine:")))


def test_benchmark_passes_alternate_and_report_the_median(tmp_path, monkeypatch):
    """--passes N: every method timed N times over the same prompts in alternating order; the row is the median pass
    and lists all of them, and the table shows the median rows (not the passes behind them)."""
    sys.path.insert(0, str(ROOT / "examples"))
    from benchmark import load_target
    from results_tables import bench_table

    target = load_target("tiny", torch.float32, "cpu")
    build_drafter(target, "dflash", True).save_pretrained(tmp_path / "drafter")
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "mtbench.jsonl").write_text("".join(json.dumps({"id": i, "input_ids": [3 + i, 7, 11]}) + "\n"
                                                   for i in range(2)))
    out = tmp_path / "out"
    script = ROOT / "examples" / "benchmark.py"
    _in_process(monkeypatch, script, ["--target", "tiny", "--drafters", f"m={tmp_path / 'drafter'}", "--datasets",
                                      "mtbench", "--prompts_dir", prompts, "--max_new_tokens", "6", "--methods",
                                      "engine_ar", "engine", "hf_eager", "--passes", "3", "--out", out], tmp_path)
    raw = [json.loads(x) for x in (out / "bench_raw.jsonl").read_text().splitlines()]
    passes = [r for r in raw if "pass" in r]
    assert [r["method"] for r in passes] == ["engine_ar@1", "engine:m@1", "hf_eager",  # pass 0 forward,
                                             "hf_eager", "engine:m@1", "engine_ar@1",  # pass 1 reversed
                                             "engine_ar@1", "engine:m@1", "hf_eager"]
    rows = json.loads((out / "bench.json").read_text())["results"]
    assert len(rows) == 3 and json.loads((out / "bench.json").read_text())["passes"] == 3
    assert all(len(r["host_load"]) == 2 for r in raw)  # the host's load beside every measurement
    for r in rows:
        mine = sorted(x["tok_per_s"] for x in passes if x["method"] == r["method"])
        assert sorted(r["tok_per_s_passes"]) == mine and r["tok_per_s"] == mine[1] and "pass" not in r
    table = bench_table([out / "bench_raw.jsonl"])
    assert table.count("| mtbench |") == 3 and "(pass" not in table
    cut = tmp_path / "cut.jsonl"  # a run cut before its medians: the passes show, labelled
    cut.write_text("".join(json.dumps(r) + "\n" for r in passes[:2]))
    assert bench_table([cut]).count("(pass 0)") == 2
    with pytest.raises(SystemExit) as refused:  # the exit status `python benchmark.py --passes 0` ends with
        _in_process(monkeypatch, script, ["--target", "tiny", "--passes", "0", "--out", tmp_path / "x"], tmp_path)
    assert refused.value.code not in (0, None)


def test_benchmark_continuous_rows(tmp_path, monkeypatch, capsys):
    """--batching continuous: engine rows serve the dataset through b rows refilled as they finish; named @<b>c, paired
    with engine_ar@<b>c as their own AR row, and (fp32, greedy) the same tokens and τ as static batches of the same
    size, measured in the same run (one process: the shapes are shared)."""
    sys.path.insert(0, str(ROOT / "examples"))
    from benchmark import load_target
    from results_tables import bench_table

    target = load_target("tiny", torch.float32, "cpu")
    build_drafter(target, "dflash", True).save_pretrained(tmp_path / "drafter")
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "mtbench.jsonl").write_text("".join(json.dumps({"id": i, "input_ids": [3 + i, 7, 11][: 1 + i % 3]})
                                                   + "\n" for i in range(5)))
    out = tmp_path / "out"
    capsys.readouterr()
    _in_process(monkeypatch, ROOT / "examples" / "benchmark.py", [
        "--target", "tiny", "--drafters", f"m={tmp_path / 'drafter'}", "--datasets", "mtbench", "--prompts_dir",
        prompts, "--max_new_tokens", "9", "--methods", "engine_ar", "engine", "engine_lookup", "--lookup", "3",
        "--batch_sizes", "2", "--batching", "static", "continuous", "--out", out], tmp_path)
    stderr = capsys.readouterr().err
    summary = json.loads((out / "bench.json").read_text())
    assert summary["batching"] == ["static", "continuous"]
    by = {r["method"]: r for r in summary["results"]}
    static = {"engine_ar@2", "engine:m@2", "engine_lookup:m@2"}
    assert set(by) == static | {m + "c" for m in static}
    # 5 prompts in static batches of 2: the partial last batch is recorded and warned about once; continuous has none
    assert all(by[m]["partial_batch_rows"] == 1 and "partial_batch_rows" not in by[m + "c"] for m in static)
    assert stderr.count("leave a last batch of 1 rows") == 1
    for m in static:
        assert (by[m + "c"]["tokens"], by[m + "c"]["tau"]) == (by[m]["tokens"], by[m]["tau"]), m
    table = bench_table([out / "bench_raw.jsonl"]).splitlines()
    for m in ("engine:m@2c", "engine_lookup:m@2c", "engine_lookup:m@2"):  # "× own AR": engine_ar of the same batching
        line = next(x for x in table if f"| {m} |" in x)
        assert line.endswith(f"| {by[m]['tok_per_s'] / by['engine_ar@' + m.split('@')[1]]['tok_per_s']:.2f} | – |")


def test_benchmark_ignore_eos_decodes_past_eos_in_engine_rows(tmp_path, monkeypatch, capsys):
    """--ignore_eos: engine rows decode exactly max_new_tokens per prompt (caches filled to a known length), where
    the same prompts stop at the tiny target's EOS without it; rows of other methods are refused by name."""
    prompts = tmp_path / "prompts"
    prompts.mkdir()  # the tiny target (seeded) reaches its EOS (95) after 6 and 11 tokens from these prompts
    (prompts / "mtbench.jsonl").write_text("".join(json.dumps({"id": i, "input_ids": q}) + "\n"
                                                   for i, q in enumerate([[8, 7, 11], [6, 7, 11]])))
    base = ["--target", "tiny", "--datasets", "mtbench", "--prompts_dir", prompts, "--max_new_tokens", "20",
            "--batch_sizes", "2"]
    tokens = {}
    for flag in ([], ["--ignore_eos"]):
        out = tmp_path / f"out{len(flag)}"
        _in_process(monkeypatch, ROOT / "examples" / "benchmark.py", base + ["--methods", "engine_ar", *flag,
                                                                             "--out", out], tmp_path)
        (row,) = json.loads((out / "bench.json").read_text())["results"]
        assert row.get("ignore_eos", False) == bool(flag)
        tokens[bool(flag)] = row["tokens"]
    assert tokens == {False: 6 + 11, True: 2 * 20}
    capsys.readouterr()
    with pytest.raises(SystemExit):
        _in_process(monkeypatch, ROOT / "examples" / "benchmark.py", base + ["--methods", "engine_ar", "hf_eager",
                                                                             "--ignore_eos", "--out", tmp_path / "x"],
                    tmp_path)
    assert "--ignore_eos applies to engine rows only; select them with --methods (not: hf_eager)" in \
        capsys.readouterr().err


def test_benchmark_ar_variants_run_beside_engine_ar(tmp_path, monkeypatch, capsys):
    """--ar_variant TAG KEY=VALUE adds engine_ar:TAG rows on an engine of their own options (plain decoding on two
    settings in one call): same greedy tokens as engine_ar, the options recorded in the variant's row only; a
    malformed or repeated variant is refused by name."""
    sys.path.insert(0, str(ROOT / "examples"))
    from benchmark import parse_ar_variants

    assert parse_ar_variants([["kernel", "attention_min_rows=1", "attention=triton"]]) == {
        "kernel": {"attention_min_rows": 1, "attention": "triton"}}
    for bad, why in (([["kernel"]], "expected TAG KEY=VALUE"), ([["a=1"]], "expected TAG KEY=VALUE"),
                     ([["k", "x=1"], ["k", "y=2"]], "given twice")):
        with pytest.raises(SystemExit, match=why):
            parse_ar_variants(bad)
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "mtbench.jsonl").write_text("".join(json.dumps({"id": i, "input_ids": [3 + i, 7, 11]}) + "\n"
                                                   for i in range(2)))
    _in_process(monkeypatch, ROOT / "examples" / "benchmark.py", [
        "--target", "tiny", "--datasets", "mtbench", "--prompts_dir", prompts, "--max_new_tokens", "7", "--methods",
        "engine_ar", "--ar_variant", "blocking", "run_ahead=False", "--out", tmp_path / "out"], tmp_path)
    by = {r["method"]: r for r in json.loads((tmp_path / "out" / "bench.json").read_text())["results"]}
    assert set(by) == {"engine_ar@1", "engine_ar:blocking@1"}
    assert by["engine_ar:blocking@1"]["engine_options"] == {"run_ahead": False}
    assert "engine_options" not in by["engine_ar@1"]
    assert by["engine_ar:blocking@1"]["tokens"] == by["engine_ar@1"]["tokens"] == 14


def test_benchmark_ar_variant_inductor_options_go_over_the_global_ones():
    """--ar_variant TAG compile_options={...}: that row's engine compiles with --inductor's options and the variant's
    over them (e.g. coordinate-descent tuning beside the default, one call); the variant's own options are what its
    row records as engine options; a value that is no dict is refused by name. Built, not run: the compile is lazy."""
    sys.path.insert(0, str(ROOT / "examples"))
    from benchmark import load_target, make_engine, parse_ar_variants

    (tag, own), = parse_ar_variants([["cdt", "compile_options={'coordinate_descent_tuning':True,'freezing':False}"]]
                                    ).items()
    assert tag == "cdt" and own == {"compile_options": {"coordinate_descent_tuning": True, "freezing": False}}
    target = load_target("tiny", torch.float32, "cpu")
    glob = {"freezing": True, "fx_graph_cache": False}
    engine = make_engine(target, None, 64, compile=True, compile_options=glob, engine_options=own)
    assert engine.compile_options == {"freezing": False, "fx_graph_cache": False, "coordinate_descent_tuning": True}
    assert engine.options == own and glob == {"freezing": True, "fx_graph_cache": False}
    plain = make_engine(target, None, 64, compile=True, compile_options=glob)
    assert plain.compile_options == glob and plain.options == {}
    with pytest.raises(SystemExit, match="compile_options=3: expected a dict of inductor options"):
        make_engine(target, None, 64, compile=True, compile_options=glob, engine_options={"compile_options": 3})


def test_benchmark_inductor_options_are_parsed_and_need_compile(tmp_path, monkeypatch, capsys):
    """--inductor KEY=VALUE reaches the engine as compile_options (Python literals, dotted keys kept); a pair that is
    no KEY=literal, or --inductor without --compile, is refused with the reason."""
    sys.path.insert(0, str(ROOT / "examples"))
    from benchmark import parse_inductor_options

    assert parse_inductor_options(["freezing=True", "cpp.enable_concat_linear=True", "x=3"]) == {
        "freezing": True, "cpp.enable_concat_linear": True, "x": 3}
    for bad in (["freezing"], ["freezing=yes please"], ["=True"]):
        with pytest.raises(SystemExit, match="expected KEY=VALUE"):
            parse_inductor_options(bad)
    from benchmark import parse_engine_options  # the same pairs, but a value may be text (attention=triton)

    assert parse_engine_options(["attention=triton", "attention_block_n=128"]) == {
        "attention": "triton", "attention_block_n": 128}
    with pytest.raises(SystemExit, match="engine option 'attention': expected KEY=VALUE, e.g. attention=triton"):
        parse_engine_options(["attention"])
    with pytest.raises(SystemExit) as refused:
        _in_process(monkeypatch, ROOT / "examples" / "benchmark.py", ["--target", "tiny", "--inductor", "freezing=True",
                                                                      "--out", tmp_path / "x"], tmp_path)
    assert refused.value.code not in (0, None) and "it needs --compile" in capsys.readouterr().err


def test_benchmark_passes_a_specs_engine_keys_and_records_them(tmp_path):
    """`NAME=FOLDER,lookup_min_ngram=2` in --drafters builds that drafter's engine with the setting (two specs of one
    folder time two settings side by side), and its rows say which setting they timed."""
    sys.path.insert(0, str(ROOT / "examples"))
    from benchmark import load_target, make_engine, run_engine
    from evaluate_tau import load_drafters

    target = load_target("tiny", torch.float32, "cpu")
    build_drafter(target, "dflash", True).save_pretrained(tmp_path / "d")
    drafters = load_drafters([f"a={tmp_path / 'd'}", f"b={tmp_path / 'd'},lookup_min_ngram=2"], torch.float32, "cpu")
    engines = {n: make_engine(target, d, 64) for n, d in drafters.items()}
    assert engines["a"].lookup_min_ngram == 3 and engines["b"].lookup_min_ngram == 2
    rows = {n: run_engine(e, [[3, 7, 11, 3, 7]], 6, 1, None, lookup=3) for n, e in engines.items()}
    assert "engine_options" not in rows["a"] and rows["b"]["engine_options"] == {"lookup_min_ngram": 2}
    import inspect

    from evaluate_tau import ENGINE_KEYS
    from hf_carryover.engine.engine import SpeculativeEngine
    params = inspect.signature(SpeculativeEngine).parameters  # a spec key the engine does not take fails late, on a GPU
    assert [k for k in ENGINE_KEYS if k not in params] == []
    # and an engine option missing from ENGINE_KEYS would reach from_pretrained as a config field, not the engine:
    # every argument but those benchmark.py sets itself must be a spec key
    own = {"target", "drafter", "max_len", "profile", "cuda_graphs", "compile", "compile_options"}
    assert [k for k in params if k not in ENGINE_KEYS and k not in own] == []


def test_benchmark_spec_inductor_keys_compile_that_drafters_engine_with_them(tmp_path, monkeypatch, capsys):
    """`NAME=FOLDER,inductor.KEY=VALUE` in --drafters: that drafter's engine compiles with --inductor's options and the
    spec's over them (a tree row with PDL beside one without, in one process); the other spec of the same folder keeps
    --inductor's alone. Such a key needs --compile (benchmark.py) and is refused by evaluate_tau.py, whose engine is
    not compiled. Built, not run: the compile is lazy."""
    sys.path.insert(0, str(ROOT / "examples"))
    from benchmark import load_target, make_engine
    from evaluate_tau import load_drafters

    target = load_target("tiny", torch.float32, "cpu")
    build_drafter(target, "dflash", True).save_pretrained(tmp_path / "d")
    drafters = load_drafters([f"a={tmp_path / 'd'}",
                              f"pdl={tmp_path / 'd'},inductor.triton.enable_pdl=true,inductor.freezing=false"],
                             torch.float32, "cpu")
    assert drafters["pdl"]._eval_engine == {"compile_options": {"triton.enable_pdl": True, "freezing": False}}
    glob = {"freezing": True, "fx_graph_cache": False}
    engines = {n: make_engine(target, d, 64, compile=True, compile_options=glob) for n, d in drafters.items()}
    assert engines["a"].compile_options == glob and engines["a"].options == {}
    assert engines["pdl"].compile_options == {"freezing": False, "fx_graph_cache": False, "triton.enable_pdl": True}
    assert engines["pdl"].options == {"compile_options": {"triton.enable_pdl": True, "freezing": False}}
    assert glob == {"freezing": True, "fx_graph_cache": False}
    spec = f"pdl={tmp_path / 'd'},inductor.triton.enable_pdl=true"
    with pytest.raises(SystemExit) as refused:
        _in_process(monkeypatch, ROOT / "examples" / "benchmark.py", ["--target", "tiny", "--drafters", spec,
                                                                      "--out", tmp_path / "x"], tmp_path)
    assert refused.value.code not in (0, None) and "inductor.KEY=VALUE sets options of the compiled rounds: it needs " \
        "--compile" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        _in_process(monkeypatch, ROOT / "examples" / "evaluate_tau.py", ["--drafters", spec, "--engine",
                                                                         "--out", tmp_path / "y"], tmp_path)
    assert "engine is not compiled (examples/benchmark.py --compile takes them)" in str(refused.value.code)


def test_benchmark_engine_rows_split_a_batch_into_launched_rounds_and_row_rounds():
    """At batch 2, static batches, with an EOS that ends one row early: `row_rounds` is every row's rounds (plain
    decoding: its steps), `launched_rounds` the rounds the batches ran (the engine's own count: each batch as long as
    its slowest row, plus a run-ahead round where the loop runs ahead), and `batch_fill` the share of row slots in them
    that decoded; at batch 1 the same prompts fill every round but the run-ahead ones."""
    sys.path.insert(0, str(ROOT / "examples"))
    from benchmark import run_engine

    from hf_carryover.engine.engine import SpeculativeEngine

    target = build_target("llama", seed=5)
    prompts = [[3, 7, 11, 3, 7], [2, 4, 6], [8, 10, 12, 14], [1, 3, 1, 3, 5]]
    alone = SpeculativeEngine(target, None, max_len=64)
    eos = alone.generate(prompts[:1], max_new_tokens=12)[0][3]  # prompt 0 stops at its 4th token
    for drafter, extra in ((None, {}), (build_drafter(target, "dflash", True), {"lookup": 3})):
        engine = SpeculativeEngine(target, drafter, max_len=64)
        blocking = SpeculativeEngine(target, drafter, max_len=64, run_ahead=False)
        own, logged = [], 0  # the rounds each prompt's row decoded in, decoded alone (no run-ahead: all launched)
        for p in prompts:
            blocking.generate([p], max_new_tokens=12, eos_token_id=eos, prompt_lookup_num_tokens=extra.get("lookup"))
            own.append(blocking.last_launched)
            logged += len(blocking.rounds[0])
        # the drafter's last round of a full-length row has no room for a draft, and the log (τ's) leaves it out
        assert (sum(own) > logged) if drafter is not None else (sum(own) == logged)
        two = run_engine(engine, prompts, 12, 2, eos, **extra)
        slowest = max(own[:2]) + max(own[2:])
        assert two["row_rounds"] == sum(own)
        assert slowest <= two["launched_rounds"] <= slowest + 2  # + at most one run-ahead round a batch
        assert two["batch_fill"] == sum(own) / (2 * two["launched_rounds"]) < 1
        assert two["ms_per_launched_round"] == pytest.approx(1000 * two["seconds"] / two["launched_rounds"])
        one = run_engine(engine, prompts, 12, 1, eos, **extra)
        assert one["row_rounds"] == sum(own) <= one["launched_rounds"] <= sum(own) + len(prompts)
        assert one["batch_fill"] > two["batch_fill"]
    assert own[0] < max(own)  # the EOS really ended a row early


def test_benchmark_engine_rows_split_their_untimed_cost():
    """A row records what its untimed part cost: the engine's build (its first row only), the warm-up calls (one per
    batch shape and prompt-width bucket) and, compiled, the compile phases they ran. A second row on the same engine
    and shapes warms up again but compiles nothing, and no row compiles inside its timed calls."""
    sys.path.insert(0, str(ROOT / "examples"))
    from benchmark import make_engine, run_engine

    from hf_carryover.engine.refill import width_bucket

    target = build_target("llama", seed=5)
    prompts = [[3, 7, 11], [2, 4, 6, 8] * 33, [8, 10, 12, 14]]  # two width buckets (128 and 256)
    buckets = {width_bucket(len(p), 320) for p in prompts}
    assert len(buckets) == 2
    engine = make_engine(target, build_drafter(target, "dflash", True), 320, compile="aot_eager")
    first = run_engine(engine, prompts, 6, 1, None)
    assert first["warmup_calls"] == 2 and first["warmup_s"] > 0 and first["engine_build_s"] >= 0
    phases = first["compile_phases_s"]
    assert phases and all(n >= 1 and t >= 0 for n, t in phases.values()), phases
    assert max(t for _, t in phases.values()) <= first["warmup_s"]  # nested phases, each within the warm-up
    assert "timed_compile_phases_s" not in first
    again = run_engine(engine, prompts, 6, 1, None)
    assert again["warmup_calls"] == 2 and again["compile_phases_s"] == {} and "engine_build_s" not in again
    assert "timed_compile_phases_s" not in again
    assert again["tokens"] == first["tokens"]
    eager = run_engine(make_engine(target, None, 320), prompts[:1], 6, 1, None)
    assert eager["warmup_calls"] == 1 and "compile_phases_s" not in eager


def test_benchmark_refuses_lookup_rows_the_drafter_code_ignores(monkeypatch):
    """A drafter folder saved before context lookup existed runs remote code that ignores prompt_lookup_num_tokens
    (2026-11-30h: such rows measured plain drafting under the lookup label). run_hf must stop with the folder named,
    and pass when the generator took the setting."""
    sys.path.insert(0, str(ROOT / "examples"))
    import benchmark
    from conftest import build_drafter, build_target

    target = build_target("llama")
    drafter = build_drafter(target, "dflash", False)
    prompts = [[3, 7, 1, 5, 3, 7, 1]]
    res = benchmark.run_hf(target, prompts, 6, assistant_model=drafter, prompt_lookup_num_tokens=3)
    assert res["tokens"] == 6
    original = type(drafter).make_candidate_generator

    def stale(self, *args, **kwargs):  # what an old folder's generator does: no lookup, whatever was asked
        gen = original(self, *args, **kwargs)
        gen.lookup_tokens = None
        return gen

    monkeypatch.setattr(type(drafter), "make_candidate_generator", stale)
    with pytest.raises(SystemExit, match="ignores prompt_lookup_num_tokens"):
        benchmark.run_hf(target, prompts, 6, assistant_model=drafter, prompt_lookup_num_tokens=3)


def test_evaluate_tau_refuses_engine_keys_without_engine(tmp_path, monkeypatch):
    """`lookup_siblings=false` is a SpeculativeEngine argument: without --engine the script says so before loading
    anything, instead of passing it to the drafter's config."""
    with pytest.raises(SystemExit) as refused:  # the message `python evaluate_tau.py ...` ends with, status 1
        _in_process(monkeypatch, ROOT / "examples" / "evaluate_tau.py",
                    ["--drafters", "x=nowhere,lookup=4,lookup_siblings=false", "--out", tmp_path], tmp_path)
    message = str(refused.value.code)
    assert "]: lookup_siblings (of lookup_siblings/" in message, message
    from evaluate_tau import ENGINE_KEYS
    assert f"{'/'.join(ENGINE_KEYS)}) are SpeculativeEngine arguments: they need --engine" in message


def test_evaluate_tau_cut_run_keeps_its_command(tmp_path, monkeypatch):
    """A generate() run cut by a time limit writes no summary; `--summarize_only` later must credit the measuring
    command (from run.json), not itself. Datasets are interleaved, so each has its first prompt done."""
    sys.path.insert(0, str(ROOT / "examples"))
    from benchmark import load_target

    target = load_target("tiny", torch.float32, "cpu")
    target.save_pretrained(tmp_path / "target")
    build_drafter(target, "dflash", True).save_pretrained(tmp_path / "drafter")
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    for d in ("mtbench", "humaneval"):
        (prompts / f"{d}.jsonl").write_text("".join(json.dumps({"id": f"{d}{i}", "input_ids": [3 + i, 7, 11]}) + "\n"
                                                    for i in range(2)))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    script = ROOT / "examples" / "evaluate_tau.py"

    def run(*args):  # the later runs of the script, in this process (the measuring run below is a real process)
        _in_process(monkeypatch, script, args, tmp_path)

    common = ["--target", str(tmp_path / "target"), "--drafters", f"m={tmp_path / 'drafter'}", "--prompts_dir",
              str(prompts), "--datasets", "mtbench", "humaneval", "--dtype", "float32", "--out", str(tmp_path / "t")]
    subprocess.run([sys.executable, str(script), *common, "--max_new_tokens", "5"], check=True, env=env,
                   capture_output=True, cwd=tmp_path)
    (tmp_path / "t" / "summary.json").unlink()  # as if cut before summarising
    raw = [json.loads(x) for x in (tmp_path / "t" / "raw-0.jsonl").read_text().splitlines()]
    assert [r["id"] for r in raw] == ["mtbench0", "humaneval0", "mtbench1", "humaneval1"]  # interleaved
    run(*common, "--summarize_only")
    summary = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert "--max_new_tokens 5" in summary["command"] and "--summarize_only" not in summary["command"]
    assert summary["results"]["m|mtbench|T=0.0"]["prompts"] == 2
    # a drafter with context lookup: its records count the looked-up rounds, through generate() and the engine alike;
    # the offline replay refuses it
    loop = [json.dumps({"id": "loop", "input_ids": [3, 7, 11, 5, 3, 7, 11]}) + "\n"]
    (prompts / "mtbench.jsonl").write_text("".join(loop))
    lk = ["--target", str(tmp_path / "target"), "--drafters", f"l={tmp_path / 'drafter'},lookup=3", "--prompts_dir",
          str(prompts), "--datasets", "mtbench", "--dtype", "float32", "--max_new_tokens", "6"]
    run(*lk, "--out", tmp_path / "lk")
    rec = json.loads((tmp_path / "lk" / "raw-0.jsonl").read_text().splitlines()[0])
    assert rec["lookup"] == 3 and rec["lookup_rounds"] >= 0  # generate() handed the option to the generator
    run(*lk, "--engine", "--out", tmp_path / "lk2")
    eng = json.loads((tmp_path / "lk2" / "raw-engine.jsonl").read_text().splitlines()[0])
    assert eng["lookup"] == 3 and eng["accepted"] == rec["accepted"]  # the engine's rounds are generate()'s
    assert eng["lookup_rounds"] == rec["lookup_rounds"]
    # a draft tree: generate() (drafter.use_draft_tree) and the engine record the same tree rounds
    tree = tmp_path / "tree.json"
    tree.write_text(json.dumps({"paths": [[0], [1], [0, 0], [1, 0], [0, 0, 0]]}))
    tr = [*lk[:3], f"t={tmp_path / 'drafter'},tree={tree},tree_nodes=3,lookup=3", *lk[4:]]
    run(*tr, "--out", tmp_path / "tr")
    run(*tr, "--engine", "--out", tmp_path / "tr2")
    gen, eng = (json.loads((tmp_path / d / f).read_text().splitlines()[0])
                for d, f in (("tr", "raw-0.jsonl"), ("tr2", "raw-engine.jsonl")))
    assert gen["tree_nodes"] == eng["tree_nodes"] == 3 and gen["tree"] == eng["tree"] == str(tree)
    assert gen["accepted"] == eng["accepted"] and gen["lookup_rounds"] == eng["lookup_rounds"]
    assert len(eng["looked"]) == len(eng["accepted"]) and sum(eng["looked"]) == eng["lookup_rounds"]
    # re-summarising an engine run reads its records and measures nothing (it used to decode again and append)
    raw_before = (tmp_path / "tr2" / "raw-engine.jsonl").read_text()
    (tmp_path / "tr2" / "summary.json").unlink()
    run(*tr, "--engine", "--summarize_only", "--out", tmp_path / "tr2")
    assert (tmp_path / "tr2" / "raw-engine.jsonl").read_text() == raw_before
    assert "--summarize_only" not in json.loads((tmp_path / "tr2" / "summary.json").read_text())["command"]
    with pytest.raises(SystemExit, match="offline replay has no lookup"):
        run(*lk, "--offline", "--out", tmp_path / "lk3")


def test_gpu_engine_check_tiny_cpu(tmp_path, monkeypatch, capsys):
    """trainer/gpu_engine_check.py end to end on CPU with a tiny target: every row present, exact, no errors
    (the graph engine runs eagerly here, so this checks the plumbing, not the graphs)."""
    out = tmp_path / "engine_check.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    script = ROOT / "trainer" / "gpu_engine_check.py"
    cmd = [sys.executable, str(script), "--device", "cpu", "--tiny",
           "--max_new_tokens", "8", "--reps", "1", "--sampled", "--out", str(out)]
    _in_process(monkeypatch, script, cmd[2:], tmp_path)  # the --compile run below is a real process
    summary = json.loads(out.read_text())
    rows = summary["rows"]
    assert all(r["graph_sampled_same_tokens"] for r in rows if r["dtype"] == "fp32")
    assert all(r["graph_sampled_boundary"] is None for r in rows if r["dtype"] == "fp32")  # nothing parted
    assert all(r["graph_sampled_tok_per_s"] > 0 for r in rows if r["dtype"] == "bf16")
    assert [(r["dtype"], r["method"], r["batch"]) for r in rows] == [
        (d, m, b) for d in ("fp32", "bf16") for m in ("ar", "dflash") for b in (1, 4)]
    assert not [r for r in rows if "error" in r], rows
    assert summary["all_exact"] and not summary["graphs_used"]
    assert {r.get("mode", r.get("graph_mode")) for r in rows} == {"eager (no CUDA)"}
    assert all(r["eager_tok_per_s"] > 0 and r["graph_tok_per_s"] > 0 for r in rows if r["dtype"] == "bf16")
    # --compile (the H200 run's form): compiled greedy rounds exact, and a compiled sampled call draws the eager tokens
    # (a process of its own: the script's command line, and Dynamo's state stays out of this one)
    # (--engine_options: every engine on the RoPE tables here, recorded; --compile_engine_options: the compiled
    # engine's own, recorded, and refused without --compile)
    with pytest.raises(SystemExit):
        _in_process(monkeypatch, script, cmd[2:-2] + ["--compile_engine_options", "gemv_rows=1", "--out", str(out)],
                    tmp_path)
    assert "--compile_engine_options are the compiled engine's: they need --compile" in capsys.readouterr().err
    cmd_c = cmd[:-3] + ["--compile", "--compile_backend", "aot_eager", "--dtypes", "fp32", "--kinds", "dflash",
                        "--batch_sizes", "1", "--engine_options", "rope_table=True",
                        "--compile_engine_options", "run_ahead=False", "--out", str(out)]
    res = subprocess.run(cmd_c, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    summary_c = json.loads(out.read_text())
    (row,) = summary_c["rows"]
    assert summary_c["engine_options"] == {"rope_table": True}
    assert summary_c["compile_engine_options"] == {"run_ahead": False}
    assert row["compile_exact"] and row["compile_sampled_same_tokens"], row
    assert row["compile_sampled_mode"] == "eager (no CUDA) +compile"
    assert row["compile_gemv_rows"] == 0  # gemv_rows="auto" on a CPU target (and without frozen weights): off
    assert "compile_frozen_pass" not in row  # no frozen weights here: the pass is not installed, nothing to record
    # --compile_only: the compiled engine against the eager one alone (here with continuous batching), each stage
    # written and announced as it finishes; refused without --compile
    cmd_o = cmd_c[:-2] + ["--compile_only", "--continuous", "--prefill_ahead", "2", "--out", str(out)]
    res = subprocess.run(cmd_o, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    summary_o = json.loads(out.read_text())
    (row,) = summary_o["rows"]
    assert summary_o["compile_only"] and summary_o["all_exact"] and row["done"] == "all", row
    assert row["compile_exact"] and "exact" not in row and "graph_sampled_same_tokens" not in row, row
    assert row["graph_compile_continuous_exact"] and row["graph_compile_ahead_continuous_exact"], row
    assert row["graph_compile_ahead2_continuous_exact"], row  # (--prefill_ahead 2: two prompts a forward)
    stages = [line.split(": ", 1)[1] for line in res.stdout.splitlines() if line.startswith("[")]
    assert stages[:3] == ["eager reference", "graph_compile against eager", "eager continuous"], stages
    with pytest.raises(SystemExit):
        _in_process(monkeypatch, script, [a for a in cmd_o[2:] if a != "--compile"], tmp_path)
    assert "--compile_only checks the compiled engine's exactness" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        i = cmd_o.index("--prefill_ahead")
        _in_process(monkeypatch, script, cmd_o[2 : i + 1] + ["1"] + cmd_o[i + 2 :], tmp_path)
    assert "--prefill_ahead 1: needs --continuous and N >= 2" in capsys.readouterr().err
    # --lookup --deterministic: looping prompts, so lookup rounds and drafter-free rounds happen; the skipping eager
    # engine equals the always-drafting one, greedy and sampled; bf16 rows repeat their tokens
    cmd_l = cmd[:-3] + ["--lookup", "3", "--deterministic", "--kinds", "dflash", "--batch_sizes", "1", "--out",
                        str(out)]
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what --deterministic sets, undone after the test
    try:
        _in_process(monkeypatch, script, cmd_l[2:], tmp_path)
    finally:  # --deterministic switches PyTorch's deterministic algorithms on for the process
        torch.use_deterministic_algorithms(False)
    summary = json.loads(out.read_text())
    fp32, bf16 = summary["rows"]
    assert summary["all_exact"] and summary["deterministic"] and summary["lookup"] == 3
    assert fp32["eager_skip_exact"] and fp32["eager_skip_skipped_drafts"] > 0
    assert fp32["eager_skip_sampled_same_tokens"] and fp32["graph_always_sampled_same_tokens"]
    assert bf16["graph_repeat_same_tokens"]


def test_gpu_engine_check_trained_drafter_real_prompts_cpu(tmp_path, monkeypatch, capsys):
    """--target/--drafter/--prompts_dir: a saved target, a drafter trained on its rollouts (so drafts are accepted,
    unlike a random drafter's) and prompt files. Every engine equals the eager one, and at batch 1 the eager engine
    equals plain greedy `target.generate`; continuous batching equals static batches; a drafter without its target is
    refused by name. (Compiled rounds: `test_gpu_engine_check_tiny_cpu` and tests/test_engine_capture.py.) The script
    runs in this process (`test_gpu_engine_check_tiny_cpu` runs it as a subprocess)."""
    from test_offline_tau import overfit
    from test_training import tiny_target

    from hf_carryover import Drafter

    target = tiny_target(seed=5, init=0.3)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 58, (3 + n,), generator=g).tolist() for n in range(4)]
    rollouts = [(len(x), target.generate(torch.tensor([x]), max_new_tokens=12, do_sample=False, pad_token_id=0,
                                         eos_token_id=63)[0].tolist(), 12) for x in prompts]
    torch.manual_seed(2)
    drafter = overfit(Drafter.from_target(target, drafter_type="dflash", carryover=True, block_size=4,
                                          num_hidden_layers=2, mask_token_id=5), target, rollouts)
    target.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "drafter")
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "toy.jsonl").write_text("".join(json.dumps({"input_ids": x}) + "\n" for x in prompts))
    out = tmp_path / "check.json"
    script = ROOT / "trainer" / "gpu_engine_check.py"
    cmd = [sys.executable, str(script), "--device", "cpu", "--target",
           str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), "--prompts_dir", str(tmp_path / "prompts"),
           "--dataset", "toy", "--dtypes", "fp32", "--batch_sizes", "1", "2", "--max_new_tokens", "12", "--continuous",
           "--out", str(out)]
    _in_process(monkeypatch, script, cmd[2:], tmp_path)
    summary = json.loads(out.read_text())
    rows = {(r["method"], r["batch"]): r for r in summary["rows"]}
    assert set(rows) == {(m, b) for m in ("ar", "dflash") for b in (1, 2)}
    assert summary["all_exact"], summary["rows"]
    assert rows["ar", 1]["plain_greedy_exact"] and rows["dflash", 1]["plain_greedy_exact"]
    assert "plain_greedy_exact" not in rows["dflash", 2]  # batch 1 only
    assert rows["dflash", 1]["tau"] > 1.5  # the trained drafter's drafts are accepted: longer rounds are checked
    # --continuous: both prompt sets through b rows (a refill per finished row) give every prompt its static tokens
    for row in summary["rows"]:
        assert row["eager_continuous_exact"] and row["graph_continuous_exact"], row
        assert row["eager_ahead_continuous_exact"] and row["graph_ahead_continuous_exact"], row  # prefill_ahead
    assert summary["drafter"].endswith("drafter") and summary["prompts"].endswith("toy")
    # --tree: the dflash engines verify a draft tree (5 of its nodes a round) with lookup; the same checks hold
    (tmp_path / "tree.json").write_text(json.dumps({"paths": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]}))
    cmd_t = cmd[:cmd.index("--batch_sizes")] + ["--kinds", "dflash", "--batch_sizes", "1", "2", "--max_new_tokens",
                                                "12", "--lookup", "3", "--tree", str(tmp_path / "tree.json"),
                                                "--tree_nodes", "5", "--continuous", "--out", str(out)]
    _in_process(monkeypatch, script, cmd_t[2:], tmp_path)
    summary = json.loads(out.read_text())
    assert summary["all_exact"] and summary["tree_nodes"] == 5 and summary["tree"].endswith("tree.json"), summary
    assert [(r["method"], r["batch"]) for r in summary["rows"]] == [("dflash", 1), ("dflash", 2)]
    assert summary["rows"][0]["plain_greedy_exact"] and summary["rows"][0]["tau"] > 1.5
    for row in summary["rows"]:
        assert row["eager_continuous_exact"] and row["graph_sampled_same_tokens"], row
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        _in_process(monkeypatch, script, cmd[2:3] + cmd[5:], tmp_path)  # no --target
    assert refused.value.code not in (0, None) and "--drafter needs --target" in capsys.readouterr().err
