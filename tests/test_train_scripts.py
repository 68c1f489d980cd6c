"""The trainer's scripts as a user runs them: `accelerate launch trainer/train.py` end to end, two data-parallel
processes (torchrun, gloo) against one at the same global batch, and the time limit that fits the LR schedule to a
run's minutes. Tiny in-process targets on CPU: plumbing and equalities, not training quality (that is
test_training.py's). The decoding and benchmark scripts are test_scripts.py's.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


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
def test_two_processes_train_like_one_at_equal_global_batch(tmp_path, stage, monkeypatch):
    """Data-parallel training on 2 CPU processes (torchrun, gloo) at 2 sequences each equals 1 process at 4: one SGD
    step from the same drafter on the same 4 responses gives the same weights. Responses of very different lengths, so
    that each rank's own loss mean would weigh tokens differently (what made the 2-GPU curve of 2026-11-30e sit
    below the 1-GPU one). The one process is this one (`train.main`, as test_training.py runs it): a plain
    single-process run, without the ~10 s of a torchrun launch and its interpreter."""
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
        args = ["--target", str(tmp_path / "target"), "--target_dtype", "float32",
                "--data_dir", str(data), "--init_from", str(init), "--stage", str(stage),
                "--carryover", "true" if stage == 2 else "false", "--num_anchors", "64", "--optim", "sgd",
                "--learning_rate", "0.5", "--lr_scheduler_type", "constant", "--max_grad_norm", "0",
                "--per_device_train_batch_size", str(per_device), "--max_steps", "1", "--report_to", "none",
                "--use_cpu", "true", "--save_strategy", "no", "--dataloader_num_workers", "0", "--output_dir", str(out)]
        if n_proc == 1:
            monkeypatch.syspath_prepend(str(ROOT))
            from trainer.train import main

            monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
            monkeypatch.chdir(tmp_path)
            main(args)
        else:
            # torchrun (gloo on CPU): `accelerate launch --cpu --num_processes 2` starts a single process here
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n_proc),
                   # HF_CARRYOVER_TEST_PORT_OFFSET: .ci/run runs two suites side by side, each with its own ports
                   "--master_port", str(29600 + int(os.environ.get("HF_CARRYOVER_TEST_PORT_OFFSET", 0)) + n_proc
                                        + 10 * stage), str(ROOT / "trainer" / "train.py"), *args]
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
