"""Smoke tests of the example scripts on a tiny in-process target (plumbing only; numbers are meaningless)."""

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


def test_benchmark_script_tiny(tmp_path):
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
           f"m={tmp_path / 'drafter'}", f"p={tmp_path / 'plain'}", "--datasets", "mtbench", "--prompts_dir", str(prompts), "--limit", "3",
           "--max_new_tokens", "12", "--batch_sizes", "1", "3", "--profile", "--cuda_graphs", "--lookup", "4",
           "--tree", f"p={tree}", "--tree_nodes", "3", "all", "--out", str(tmp_path / "out")]
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
    subprocess.run(cmd_t1, check=True, env=env, capture_output=True, cwd=tmp_path)
    t1 = json.loads((tmp_path / "t1" / "bench.json").read_text())
    assert t1["temperature"] == 1.0 and {r["temperature"] for r in t1["results"]} == {1.0} and t1["warmup"] == "all"
    assert {r["method"] for r in t1["results"]} == {"hf_eager", "hf_spec:m", "hf_spec:p", "engine_ar@1", "engine_ar@3",
                                                   "engine:m@1", "engine:m@3", "engine:p@1", "engine:p@3"}
    assert all(0 < r["tokens"] <= 36 for r in t1["results"]) and all(r["tau"] >= 1 for r in t1["results"]
                                                                       if r["method"].startswith(("hf_spec", "engine:")))


def test_accelerate_launch_tiny_cpu(tmp_path):
    """`accelerate launch trainer/train.py` on CPU with a tiny target: the documented entry point runs end to end."""
    from test_training import tiny_target

    from hf_carryover.training.data import regenerate_responses

    target = tiny_target()
    target.save_pretrained(tmp_path / "target")
    regenerate_responses(target, [(f"p{i}", [3 + i, 9, 4, 7]) for i in range(8)], tmp_path / "data",
                         max_new_tokens=16, batch_size=8)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           str(ROOT / "trainer" / "train.py"), "--target", str(tmp_path / "target"), "--target_dtype", "float32",
           "--data_dir", str(tmp_path / "data"), "--block_size", "4", "--num_hidden_layers", "1",
           "--mask_token_id", "5", "--per_device_train_batch_size", "4", "--num_anchors", "8", "--max_steps", "2",
           "--report_to", "none", "--use_cpu", "true", "--output_dir", str(tmp_path / "run")]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "run" / "final" / "modeling_drafter.py").exists()
    log = json.loads((tmp_path / "run" / "final" / "train_log.json").read_text())
    assert log[-1]["step"] == 2


@pytest.mark.parametrize("stage", [1, 2])
def test_two_processes_train_like_one_at_equal_global_batch(tmp_path, stage):
    """Data-parallel training on 2 CPU processes (torchrun, gloo) at 2 sequences each equals 1 process at 4: one SGD step
    from the same drafter on the same 4 responses gives the same weights. Responses of very different lengths, so
    that each rank's own loss mean would weigh tokens differently (what made the 2-GPU curve of 2026-11-30e sit
    below the 1-GPU one)."""
    from test_training import tiny_target

    from hf_carryover import Drafter

    target = tiny_target()
    target.save_pretrained(tmp_path / "target")
    data = tmp_path / "data"
    data.mkdir()
    lengths = [4, 40, 6, 5]  # response tokens: however the sampler splits them, one rank holds the long one
    torch.manual_seed(0)
    recs = [{"id": f"r{i}", "prompt_len": 3, "input_ids": torch.randint(6, 60, (3 + n,)).tolist()}
            for i, n in enumerate(lengths)]
    (data / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    init = tmp_path / "init"
    torch.manual_seed(1)
    Drafter.from_target(target, drafter_type="dflash", carryover=stage == 2, block_size=4, num_hidden_layers=1,
                        mask_token_id=5).save_pretrained(init)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}

    def run(n_proc, per_device, out):
        # torchrun (gloo on CPU): `accelerate launch --cpu --num_processes 2` starts a single process here
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n_proc),
               # HF_CARRYOVER_TEST_PORT_OFFSET: .ci/run runs two suites side by side, each with its own ports
               "--master_port", str(29600 + int(os.environ.get("HF_CARRYOVER_TEST_PORT_OFFSET", 0)) + n_proc
                                    + 10 * stage), str(ROOT / "trainer" / "train.py"),
               "--target", str(tmp_path / "target"), "--target_dtype", "float32",
               "--data_dir", str(data), "--init_from", str(init), "--stage", str(stage),
               "--carryover", "true" if stage == 2 else "false", "--num_anchors", "64", "--optim", "sgd",
               "--learning_rate", "0.5", "--lr_scheduler_type", "constant", "--max_grad_norm", "0",
               "--per_device_train_batch_size", str(per_device), "--max_steps", "1", "--report_to", "none",
               "--use_cpu", "true", "--save_strategy", "no", "--dataloader_num_workers", "0", "--output_dir", str(out)]
        # a time limit: a rank stuck in the process group's teardown must fail the test, not hang the suite
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp_path, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        return Drafter.from_pretrained(out / "final", dtype=torch.float32).state_dict()

    one, two = run(1, 4, tmp_path / "one"), run(2, 2, tmp_path / "two")
    start = Drafter.from_pretrained(init, dtype=torch.float32).state_dict()
    moved = max(float((one[k] - start[k]).abs().max()) for k in one)
    gap = max(float((one[k] - two[k]).abs().max()) for k in one)
    assert moved > 1e-3 and gap < 1e-3 * moved, (moved, gap)


def test_time_limit_fits_the_lr_schedule_to_the_budget():
    """The fitted cosine reaches its floor exactly at the projected step, and training stops there."""
    import importlib.util

    from transformers import TrainerControl, TrainerState
    from transformers.optimization import get_cosine_schedule_with_warmup

    spec = importlib.util.spec_from_file_location("train_script", ROOT / "trainer" / "train.py")
    train = importlib.util.module_from_spec(spec)
    sys.modules["train_script"] = train  # dataclasses look their module up while the file executes
    spec.loader.exec_module(train)
    now = [0.0]
    cb = train.TimeLimit(minutes=10, fit_schedule=True, calibrate=(2, 6), refit_every=50, reserve=0.0,
                         clock=lambda: now[0])
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=10_000)
    state, control = TrainerState(max_steps=10_000), TrainerControl()
    lrs = []
    for step in range(1, 10_000):
        # slow warm-up (4 s a step up to step 10), then 1 s a step: the refits must catch the speed-up
        now[0] = 4.0 * min(step, 10) + 1.0 * max(step - 10, 0)
        opt.step()
        sched.step()
        lrs.append(sched.get_last_lr()[0])
        state.global_step = step
        cb.on_step_end(None, state, control, lr_scheduler=sched)
        if control.should_training_stop:
            break
    # 600 s: 40 s of warm-up + 560 steps at 1 s = step 570; the late refits land within a few steps of it
    assert 560 <= step <= 570 and cb.stop_at == step, step
    assert lrs[-1] < 1e-3 and max(lrs) > 0.99  # decayed to the floor at the stop, after a full warm-up
    fits = [e for e in state.log_history if "schedule_fitted_to_steps" in e]
    assert len(fits) > 3 and fits[0]["schedule_fitted_to_steps"] < fits[-1]["schedule_fitted_to_steps"]


def test_time_fit_makes_a_warmup_ratio_absolute():
    """A ratio of the planned max_steps would outlast a time-fitted run; it must end by the first fit."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_script", ROOT / "trainer" / "train.py")
    train = importlib.util.module_from_spec(spec)
    sys.modules["train_script"] = train
    spec.loader.exec_module(train)
    cfg = ["--config", str(ROOT / "trainer/configs/smollm2_stage1.json"), "--output_dir", "x", "--bf16", "false"]
    _, args = train.parse(cfg + ["--max_steps", "20000"])
    assert args.get_warmup_steps(20000) == 800  # what the 2026-11-29 H200 run trained with
    train.warmup_for_time_fit(args, calibrate=(50, 150))
    assert args.get_warmup_steps(20000) == 150
    _, args = train.parse(cfg + ["--max_steps", "1000"])
    train.warmup_for_time_fit(args, calibrate=(50, 150))
    assert args.get_warmup_steps(1000) == 40  # a short plan keeps its ratio


def test_gpu_engine_check_tiny_cpu(tmp_path):
    """trainer/gpu_engine_check.py end to end on CPU with a tiny target: every row present, exact, no errors
    (the graph engine runs eagerly here, so this checks the plumbing, not the graphs)."""
    out = tmp_path / "engine_check.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "trainer" / "gpu_engine_check.py"), "--device", "cpu", "--tiny",
           "--max_new_tokens", "8", "--reps", "1", "--sampled", "--out", str(out)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads(out.read_text())
    rows = summary["rows"]
    assert all(r["graph_sampled_same_tokens"] for r in rows if r["dtype"] == "fp32")
    assert all(r["graph_sampled_tok_per_s"] > 0 for r in rows if r["dtype"] == "bf16")
    assert [(r["dtype"], r["method"], r["batch"]) for r in rows] == [
        (d, m, b) for d in ("fp32", "bf16") for m in ("ar", "dflash") for b in (1, 4)]
    assert not [r for r in rows if "error" in r], rows
    assert summary["all_exact"] and not summary["graphs_used"]
    assert {r.get("mode", r.get("graph_mode")) for r in rows} == {"eager (no CUDA)"}
    assert all(r["eager_tok_per_s"] > 0 and r["graph_tok_per_s"] > 0 for r in rows if r["dtype"] == "bf16")
    # --compile (the H200 run's form): compiled greedy rounds exact, and a compiled sampled call draws the eager tokens
    cmd_c = cmd[:-3] + ["--compile", "--compile_backend", "aot_eager", "--dtypes", "fp32", "--kinds", "dflash",
                        "--batch_sizes", "1", "--out", str(out)]
    res = subprocess.run(cmd_c, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["compile_exact"] and row["compile_sampled_same_tokens"], row
    assert row["compile_sampled_mode"] == "eager (no CUDA) +compile"
    # --lookup --deterministic: looping prompts, so lookup rounds and drafter-free rounds happen; the skipping eager
    # engine equals the always-drafting one, greedy and sampled; bf16 rows repeat their tokens
    cmd_l = cmd[:-3] + ["--lookup", "3", "--deterministic", "--kinds", "dflash", "--batch_sizes", "1", "--out", str(out)]
    res = subprocess.run(cmd_l, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads(out.read_text())
    fp32, bf16 = summary["rows"]
    assert summary["all_exact"] and summary["deterministic"] and summary["lookup"] == 3
    assert fp32["eager_skip_exact"] and fp32["eager_skip_skipped_drafts"] > 0
    assert fp32["eager_skip_sampled_same_tokens"] and fp32["graph_always_sampled_same_tokens"]
    assert bf16["graph_repeat_same_tokens"]


def test_gpu_engine_check_trained_drafter_real_prompts_cpu(tmp_path):
    """--target/--drafter/--prompts_dir: a saved target, a drafter trained on its rollouts (so drafts are accepted,
    unlike a random drafter's) and prompt files. Every engine equals the eager one, and at batch 1 the eager engine
    equals plain greedy `target.generate`; continuous batching equals static batches; a drafter without its target is
    refused by name. (Compiled rounds: `test_gpu_engine_check_tiny_cpu` and tests/test_engine.py.)"""
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
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "trainer" / "gpu_engine_check.py"), "--device", "cpu", "--target",
           str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), "--prompts_dir", str(tmp_path / "prompts"),
           "--dataset", "toy", "--dtypes", "fp32", "--batch_sizes", "1", "2", "--max_new_tokens", "12", "--continuous",
           "--out", str(out)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
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
    assert summary["drafter"].endswith("drafter") and summary["prompts"].endswith("toy")
    # --tree: the dflash engines verify a draft tree (5 of its nodes a round) with lookup; the same checks hold
    (tmp_path / "tree.json").write_text(json.dumps({"paths": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]}))
    cmd_t = cmd[:cmd.index("--batch_sizes")] + ["--kinds", "dflash", "--batch_sizes", "1", "2", "--max_new_tokens",
                                                "12", "--lookup", "3", "--tree", str(tmp_path / "tree.json"),
                                                "--tree_nodes", "5", "--continuous", "--out", str(out)]
    res = subprocess.run(cmd_t, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert summary["all_exact"] and summary["tree_nodes"] == 5 and summary["tree"].endswith("tree.json"), summary
    assert [(r["method"], r["batch"]) for r in summary["rows"]] == [("dflash", 1), ("dflash", 2)]
    assert summary["rows"][0]["plain_greedy_exact"] and summary["rows"][0]["tau"] > 1.5
    for row in summary["rows"]:
        assert row["eager_continuous_exact"] and row["graph_sampled_same_tokens"], row
    res = subprocess.run(cmd[:3] + cmd[5:], env=env, capture_output=True, text=True, cwd=tmp_path)  # no --target
    assert res.returncode != 0 and "--drafter needs --target" in res.stderr


def test_benchmark_passes_alternate_and_report_the_median(tmp_path):
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
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(ROOT / "examples" / "benchmark.py"), "--target", "tiny", "--drafters",
                    f"m={tmp_path / 'drafter'}", "--datasets", "mtbench", "--prompts_dir", str(prompts),
                    "--max_new_tokens", "6", "--methods", "engine_ar", "engine", "hf_eager", "--passes", "3",
                    "--out", str(out)], check=True, env=env, capture_output=True, cwd=tmp_path)
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
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run([sys.executable, str(ROOT / "examples" / "benchmark.py"), "--target", "tiny", "--passes", "0",
                        "--out", str(tmp_path / "x")], check=True, env=env, capture_output=True, cwd=tmp_path)


def test_benchmark_continuous_rows(tmp_path):
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
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "benchmark.py"), "--target", "tiny", "--drafters",
                          f"m={tmp_path / 'drafter'}", "--datasets", "mtbench", "--prompts_dir", str(prompts),
                          "--max_new_tokens", "9", "--methods", "engine_ar", "engine", "engine_lookup", "--lookup", "3",
                          "--batch_sizes", "2", "--batching", "static", "continuous", "--out", str(out)], check=True,
                         env=env, capture_output=True, text=True, cwd=tmp_path)
    summary = json.loads((out / "bench.json").read_text())
    assert summary["batching"] == ["static", "continuous"]
    by = {r["method"]: r for r in summary["results"]}
    static = {"engine_ar@2", "engine:m@2", "engine_lookup:m@2"}
    assert set(by) == static | {m + "c" for m in static}
    # 5 prompts in static batches of 2: the partial last batch is recorded and warned about once; continuous has none
    assert all(by[m]["partial_batch_rows"] == 1 and "partial_batch_rows" not in by[m + "c"] for m in static)
    assert run.stderr.count("leave a last batch of 1 rows") == 1
    for m in static:
        assert (by[m + "c"]["tokens"], by[m + "c"]["tau"]) == (by[m]["tokens"], by[m]["tau"]), m
    table = bench_table([out / "bench_raw.jsonl"]).splitlines()
    for m in ("engine:m@2c", "engine_lookup:m@2c", "engine_lookup:m@2"):  # "× own AR": engine_ar of the same batching
        line = next(x for x in table if f"| {m} |" in x)
        assert line.endswith(f"| {by[m]['tok_per_s'] / by['engine_ar@' + m.split('@')[1]]['tok_per_s']:.2f} | – |")


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


def test_compare_rounds(tmp_path):
    """Round-for-round comparison of two τ runs: any difference, an extra last round included, counts."""
    def raw(path, rows):
        path.write_text("".join(json.dumps({"drafter": "d", "dataset": "x", "temperature": 0.0, "id": i,
                                            "accepted": acc}) + "\n" for i, acc in rows))
        return str(path)

    a = raw(tmp_path / "a.jsonl", [(1, [3, 0, 2]), (2, [1, 1]), (3, [0, 4])])
    b = raw(tmp_path / "b.jsonl", [(1, [3, 0, 2]), (2, [1, 1, 0]), (3, [4, 0])])  # 2: one more round
    out = tmp_path / "cmp.json"
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "compare_rounds.py"), a, b, "--out", str(out)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
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
    raw.write_text("".join(json.dumps({"drafter": n, "dataset": ds, "temperature": 0.0, "id": i, "accepted": acc}) + "\n"
                           for n, ds, i, acc in recs))
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


def test_evaluate_tau_cut_run_keeps_its_command(tmp_path):
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
    script = str(ROOT / "examples" / "evaluate_tau.py")
    common = ["--target", str(tmp_path / "target"), "--drafters", f"m={tmp_path / 'drafter'}", "--prompts_dir",
              str(prompts), "--datasets", "mtbench", "humaneval", "--dtype", "float32", "--out", str(tmp_path / "t")]
    subprocess.run([sys.executable, script, *common, "--max_new_tokens", "5"], check=True, env=env,
                   capture_output=True, cwd=tmp_path)
    (tmp_path / "t" / "summary.json").unlink()  # as if cut before summarising
    raw = [json.loads(x) for x in (tmp_path / "t" / "raw-0.jsonl").read_text().splitlines()]
    assert [r["id"] for r in raw] == ["mtbench0", "humaneval0", "mtbench1", "humaneval1"]  # interleaved
    subprocess.run([sys.executable, script, *common, "--summarize_only"], check=True, env=env, capture_output=True,
                   cwd=tmp_path)
    summary = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert "--max_new_tokens 5" in summary["command"] and "--summarize_only" not in summary["command"]
    assert summary["results"]["m|mtbench|T=0.0"]["prompts"] == 2
    # a drafter with context lookup: its records count the looked-up rounds, through generate() and the engine alike;
    # the offline replay refuses it
    loop = [json.dumps({"id": "loop", "input_ids": [3, 7, 11, 5, 3, 7, 11]}) + "\n"]
    (prompts / "mtbench.jsonl").write_text("".join(loop))
    lk = ["--target", str(tmp_path / "target"), "--drafters", f"l={tmp_path / 'drafter'},lookup=3", "--prompts_dir",
          str(prompts), "--datasets", "mtbench", "--dtype", "float32", "--max_new_tokens", "6"]
    subprocess.run([sys.executable, script, *lk, "--out", str(tmp_path / "lk")], check=True, env=env,
                   capture_output=True, cwd=tmp_path)
    rec = json.loads((tmp_path / "lk" / "raw-0.jsonl").read_text().splitlines()[0])
    assert rec["lookup"] == 3 and rec["lookup_rounds"] >= 0  # generate() handed the option to the generator
    subprocess.run([sys.executable, script, *lk, "--engine", "--out", str(tmp_path / "lk2")], check=True, env=env,
                   capture_output=True, cwd=tmp_path)
    eng = json.loads((tmp_path / "lk2" / "raw-engine.jsonl").read_text().splitlines()[0])
    assert eng["lookup"] == 3 and eng["accepted"] == rec["accepted"]  # the engine's rounds are generate()'s
    assert eng["lookup_rounds"] == rec["lookup_rounds"]
    # a draft tree: generate() (drafter.use_draft_tree) and the engine record the same tree rounds
    tree = tmp_path / "tree.json"
    tree.write_text(json.dumps({"paths": [[0], [1], [0, 0], [1, 0], [0, 0, 0]]}))
    tr = [*lk[:3], f"t={tmp_path / 'drafter'},tree={tree},tree_nodes=3,lookup=3", *lk[4:]]
    subprocess.run([sys.executable, script, *tr, "--out", str(tmp_path / "tr")], check=True, env=env,
                   capture_output=True, cwd=tmp_path)
    subprocess.run([sys.executable, script, *tr, "--engine", "--out", str(tmp_path / "tr2")], check=True, env=env,
                   capture_output=True, cwd=tmp_path)
    gen, eng = (json.loads((tmp_path / d / f).read_text().splitlines()[0])
                for d, f in (("tr", "raw-0.jsonl"), ("tr2", "raw-engine.jsonl")))
    assert gen["tree_nodes"] == eng["tree_nodes"] == 3 and gen["tree"] == eng["tree"] == str(tree)
    assert gen["accepted"] == eng["accepted"] and gen["lookup_rounds"] == eng["lookup_rounds"]
    assert len(eng["looked"]) == len(eng["accepted"]) and sum(eng["looked"]) == eng["lookup_rounds"]
    # re-summarising an engine run reads its records and measures nothing (it used to decode again and append)
    raw_before = (tmp_path / "tr2" / "raw-engine.jsonl").read_text()
    (tmp_path / "tr2" / "summary.json").unlink()
    subprocess.run([sys.executable, script, *tr, "--engine", "--summarize_only", "--out", str(tmp_path / "tr2")],
                   check=True, env=env, capture_output=True, cwd=tmp_path)
    assert (tmp_path / "tr2" / "raw-engine.jsonl").read_text() == raw_before
    assert "--summarize_only" not in json.loads((tmp_path / "tr2" / "summary.json").read_text())["command"]
    bad = subprocess.run([sys.executable, script, *lk, "--offline", "--out", str(tmp_path / "lk3")], env=env,
                         capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode != 0 and "offline replay has no lookup" in bad.stderr


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
    first keys included, gives the float64 reference's result, and windows too short for the mask are skipped."""
    sys.path.insert(0, str(ROOT / "trainer"))
    import gpu_attention_bench

    out = tmp_path / "attn.json"
    res = gpu_attention_bench.main(["--device", "cpu", "--dtype", "float32", "--keys", "128", "--queries", "1", "4",
                                    "--valid", "40", "--variants", "hf", "hf_math", "gqa", "flex", "window64",
                                    "window32", "--layers", "2", "--replays", "1", "--no_compile", "--out", str(out)])
    rows = res["rows"]
    assert json.loads(out.read_text())["rows"] == rows
    assert {(r["variant"], r["q_rows"]) for r in rows} == {(v, q) for v in ("hf", "hf_math", "gqa", "flex", "window64")
                                                          for q in (1, 4)}
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


def test_plot_speed_draws_summary_rows_first_file_first(tmp_path):
    """plot_speed.py draws each method's summary row (the median of --passes, not the passes behind it); a method in
    two files is drawn from the first file named; a folder's re-run counts its last summary row; batch sizes and
    method kinds come from the names; a file without summary rows is refused by name."""
    sys.path.insert(0, str(ROOT / "examples"))
    from plot_speed import batch_of, kind_of, select_rows

    assert [batch_of(m) for m in ("engine_ar@8", "engine_ar@8c", "hf_static_compile", "engine_tree_lookup31:d@1")] \
        == [8, 8, 1, 1]
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
    only_passes = tmp_path / "cut.jsonl"
    only_passes.write_text(row("engine_ar@1", 690.0, **{"pass": 0}))
    with pytest.raises(SystemExit, match="No summary rows"):
        select_rows([only_passes])
    pytest.importorskip("matplotlib")  # the [train] extra; the rest draws the PNG
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "plot_speed.py"), str(a), str(b), "--out",
                          str(tmp_path / "speed.png")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "speed.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "not drawn" in res.stdout


def test_benchmark_inductor_options_are_parsed_and_need_compile(tmp_path):
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
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "benchmark.py"), "--target", "tiny", "--inductor",
                          "freezing=True", "--out", str(tmp_path / "x")], env=env, capture_output=True, text=True)
    assert res.returncode != 0 and "it needs --compile" in res.stderr


def test_evaluate_tau_refuses_engine_keys_without_engine(tmp_path):
    """`lookup_siblings=false` is a SpeculativeEngine argument: without --engine the script says so before loading
    anything, instead of passing it to the drafter's config."""
    script = str(ROOT / "examples" / "evaluate_tau.py")
    r = subprocess.run([sys.executable, script, "--drafters", "x=nowhere,lookup=4,lookup_siblings=false",
                        "--out", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode != 0 and "]: lookup_siblings (of lookup_siblings/" in r.stderr, r.stderr
    assert "drafter_attention) are SpeculativeEngine arguments: they need --engine" in r.stderr


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


def test_compile_census_counts_graphs_and_breaks(tmp_path):
    """examples/compile_census.py: per mode, the graphs Dynamo traced (row prefill and round) and its breaks by reason,
    written with the command and environment; a sampled tree round breaks once, on purpose, around
    `sampling.running_mass` (`torch.compiler.disable`)."""
    sys.path.insert(0, str(ROOT / "examples"))
    import compile_census

    out = tmp_path / "census.json"
    res = compile_census.main(["--modes", "ar", "tree_sampled", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == res["rows"] and res["env"]["torch"]
    ar, sampled = res["rows"]
    assert (ar["graphs"], ar["breaks"]) == (2, 0), ar
    assert sampled["breaks"] >= 1 and all("disable" in r for r in sampled["reasons"]), sampled


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
