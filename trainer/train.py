"""Train a drafter for any target:
`accelerate launch trainer/train.py --config trainer/configs/X.json [--key value ...]`.

Config keys are the fields of `ScriptArguments` below plus any `CarryoverTrainingArguments` /
`TrainingArguments` field; CLI flags override the file. Runs on CPU (tiny configs), one GPU or many.

    stage 1:  --drafter_type dflash --stage 1                 (random init, parallel anchors)
    stage 2:  --stage 2 --init_from runs/x/final --carryover true   (continue with draft-verify-draft)

`--resume_from_checkpoint auto` resumes from the newest `checkpoint-*` in `output_dir`.
Training data: response shards from `trainer/regenerate.py`; `--eval_data_dir` holds the held-out shards.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, HfArgumentParser, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from hf_carryover import Drafter
from hf_carryover.training.data import ResponseCollator, ResponseDataset
from hf_carryover.training.trainer import CarryoverTrainer, CarryoverTrainingArguments


@dataclass
class ScriptArguments:
    target: str = field(default="reference",
                        metadata={"help": "'reference' (SmolLM2-135M-Instruct) or a model folder."})
    target_dtype: str = field(default="bfloat16", metadata={"help": "dtype of the frozen target."})
    data_dir: str = field(default="data/train",
                          metadata={"help": "Folder of response shards (several: comma-separated)."})
    eval_data_dir: str | None = field(default=None, metadata={"help": "Folder of held-out response shards."})
    max_train_records: int | None = field(default=None)
    max_eval_records: int | None = field(default=64)
    drafter_type: str = field(default="dflash")
    carryover: bool = field(default=False)
    carryover_gate: float | None = field(default=None, metadata={
        "help": "With --carryover true: initial attention-logit bias of the carryover keys (e.g. -6: the gate starts "
                "almost closed); see DrafterConfig.carryover_gate. None: no gate (or the --init_from drafter's own)."})
    block_size: int = field(default=16)
    num_hidden_layers: int = field(default=5)
    mask_token_id: int | None = field(default=None)
    init_from: str | None = field(default=None, metadata={"help": "Drafter folder to continue from (stage 2)."})
    config: str | None = field(default=None, metadata={"help": "JSON config file (CLI flags override it)."})
    max_minutes: float | None = field(default=None, metadata={"help": "Safety stop after this many minutes "
                                                             "(the LR schedule still follows max_steps)."})
    fit_schedule_to_time: bool = field(default=False, metadata={"help": "With --max_minutes: time the first "
                                       "steps and shorten the LR schedule so it ends (decayed) at the deadline."})


CALIBRATE = (50, 150)  # steps timed from [0] on; first schedule fit at [1] (the warm-up must be over by then)


class TimeLimit(TrainerCallback):
    """Stops (and checkpoints) a run that outlives its time budget; the log says it stopped early.

    With `fit_schedule=True` it also *fits the LR schedule to the budget*: from step `calibrate[0]` on it
    times the steps, and at `calibrate[1]` (then at every `refit_every` steps) projects how many steps fit
    before the deadline and sets the scheduler's horizon (`num_training_steps` of the cosine/linear lambda) to
    that count; the run stops there with a decayed LR instead of being cut mid-schedule. Re-fitting matters:
    the first H200 run fitted once at steps 20-60, still inside the slow warm-up steps (0.32 s/step against
    0.17 s later), and stopped after 3.5 of its 6 minutes. Warm-up is set by `warmup_for_time_fit`. Under DDP the
    ranks agree on one count (the minimum) and one stop.
    """

    def __init__(self, minutes: float, fit_schedule: bool = False, calibrate=CALIBRATE, refit_every: int = 250,
                 reserve: float = 0.05, clock=time.time):
        self.clock = clock
        self.deadline = clock() + 60 * minutes
        self.fit_schedule, self.calibrate = fit_schedule, calibrate
        self.refit_every, self.reserve = refit_every, reserve
        self.t_calibrate = None
        self.stop_at = None

    def _due(self, step):
        c1 = self.calibrate[1]
        return step == c1 or (step > c1 and (step - c1) % self.refit_every == 0)

    def on_step_end(self, args, state, control, **kwargs):
        step, now = state.global_step, self.clock()
        if self.fit_schedule and step == self.calibrate[0]:
            self.t_calibrate = now
        if self.fit_schedule and self.t_calibrate is not None and self._due(step) and self.stop_at != -1:
            per_step = (now - self.t_calibrate) / (step - self.calibrate[0])
            fitted = step + int((self.deadline - now) * (1 - self.reserve) / max(per_step, 1e-9))
            fitted = int(_agree(min(fitted, state.max_steps), "min"))  # state.max_steps stays the plan
            if _refit_horizon(kwargs.get("lr_scheduler"), fitted):
                state.log_history.append({"schedule_fitted_to_steps": fitted, "seconds_per_step": per_step,
                                          "step": step})
                self.stop_at = fitted
            else:
                self.stop_at = -1  # cannot refit this scheduler: only the time stop applies
        if self.stop_at is not None and self.stop_at >= 0 and step >= self.stop_at:
            control.should_training_stop = True
            control.should_save = True
        elif _agree(float(now > self.deadline), "max"):
            state.log_history.append({"stopped_early_at_step": step})
            control.should_training_stop = True
            control.should_save = True


def warmup_for_time_fit(args, calibrate=CALIBRATE) -> None:
    """A warm-up *ratio* means a share of `max_steps`, but a time-fitted run stops far earlier (20000 planned,
    1029 run on the H200 on 2026-11-29: 800 warm-up steps, so LR peaked at step 800 of 1029 and most of the
    run trained at a fraction of it). With the fit, warm-up becomes absolute and ends by the first fit."""
    w = args.warmup_steps
    if w and 0 < w < 1:
        args.warmup_steps = max(1, min(int(math.ceil(w * args.max_steps)), calibrate[1]))
        print(f"[train] warm-up ratio {w} with a time-fitted schedule -> {args.warmup_steps} steps")
    elif w > calibrate[1]:
        print(f"[train] warning: {w} warm-up steps outlast the schedule fit at step {calibrate[1]}")


def _agree(value: float, op: str) -> float:
    """One value for all ranks (min or max) so that no rank stops alone and leaves the others hanging."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    dev = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([float(value)], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX)
    return float(t.item())


def _refit_horizon(scheduler, total_steps: int) -> bool:
    """Set `num_training_steps` of transformers' schedule lambdas (functools.partial objects) in place."""
    import functools

    sched = getattr(scheduler, "scheduler", scheduler)  # unwrap accelerate's AcceleratedScheduler
    lambdas = getattr(sched, "lr_lambdas", None)
    if not lambdas or not all(isinstance(f, functools.partial) and "num_training_steps" in f.keywords
                              for f in lambdas):
        print(f"[train] cannot refit the LR schedule of {type(sched).__name__}; only the time stop applies")
        return False
    sched.lr_lambdas = [functools.partial(f.func, *f.args, **{**f.keywords, "num_training_steps": total_steps})
                        for f in lambdas]
    return True


def parse(argv):
    """Merge a JSON config file with CLI flags (CLI wins) and parse into the two dataclasses."""
    merged = []
    if "--config" in argv:
        cfg = json.loads(Path(argv[argv.index("--config") + 1]).read_text())
        for key, value in cfg.items():
            merged += [f"--{key}", json.dumps(value) if isinstance(value, (list, dict)) else str(value)]
    merged += argv
    return HfArgumentParser((ScriptArguments, CarryoverTrainingArguments)).parse_args_into_dataclasses(args=merged)


def load_target(script: ScriptArguments):
    dtype = getattr(torch, script.target_dtype)
    if script.target == "reference":
        from hf_carryover.reference import reference_target

        target, tokenizer = reference_target(dtype=dtype)
        return target, tokenizer.pad_token_id
    target = AutoModelForCausalLM.from_pretrained(script.target, dtype=dtype)
    return target, target.config.pad_token_id


def build_drafter(script: ScriptArguments, target):
    gate = {} if script.carryover_gate is None else {"carryover_gate": script.carryover_gate}
    if script.init_from:
        # fp32 master weights whatever the folder holds: a shipped or packed drafter is bf16, and transformers 5
        # loads it as stored; training it in bf16 would drop Adam's small updates (bf16 autocast computes anyway)
        drafter = Drafter.from_pretrained(script.init_from, carryover=script.carryover, dtype=torch.float32, **gate)
        drafter.bind_target(target)  # fails loudly on a mismatched target
        return drafter
    mask_id = script.mask_token_id
    if mask_id is None and script.target == "reference":
        from hf_carryover.reference import SMOLLM2_MASK_TOKEN_ID as mask_id
    return Drafter.from_target(target, drafter_type=script.drafter_type, carryover=script.carryover,
                               block_size=script.block_size, num_hidden_layers=script.num_hidden_layers,
                               mask_token_id=mask_id, **gate).float()


def main(argv=None):
    script, args = parse(sys.argv[1:] if argv is None else argv)
    if script.max_minutes and script.fit_schedule_to_time:
        warmup_for_time_fit(args)
    target, pad_id = load_target(script)
    drafter = build_drafter(script, target)
    train = ResponseDataset(script.data_dir, max_records=script.max_train_records)
    evald = ResponseDataset(script.eval_data_dir, max_records=script.max_eval_records) if script.eval_data_dir else None
    pad_id = pad_id if pad_id is not None else 0
    trainer = CarryoverTrainer(model=drafter, args=args, target=target, train_dataset=train, eval_dataset=evald,
                               data_collator=ResponseCollator(pad_id, args.max_seq_len),
                               callbacks=[TimeLimit(script.max_minutes, script.fit_schedule_to_time)]
                               if script.max_minutes else None)
    resume = args.resume_from_checkpoint
    if resume == "auto":
        resume = get_last_checkpoint(args.output_dir) if Path(args.output_dir).is_dir() else None
    trainer.train(resume_from_checkpoint=resume)
    final = Path(args.output_dir) / "final"
    trainer.save_model(str(final))
    if evald is not None:
        metrics = trainer.evaluate()
        if trainer.is_world_process_zero():
            (final / "eval_metrics.json").write_text(json.dumps(metrics, indent=2))
    if trainer.is_world_process_zero():
        (final / "train_log.json").write_text(json.dumps(trainer.state.log_history, indent=2))
    _close_process_group(trainer)
    return trainer


def _close_process_group(trainer):
    """End a data-parallel run in step. Why: left to interpreter exit, the process group is torn down by whatever
    releases it last, DDP's gradient reducer included, at a moment when the other rank may have exited already;
    with gloo on CPU that aborted a finished rank (SIGABRT, "terminate called without an active exception") in one
    CI run, and destroying the group while the reducer still held it hung the other rank in the group's destructor.
    So all ranks wait for rank 0's files, drop the DDP wrapper (and accelerate's references to it) while every rank
    is still there, wait again, and only then close the group."""
    import gc

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    trainer.model_wrapped = trainer.model  # the drafter itself; the DDP wrapper goes with the last references
    trainer.accelerator.free_memory()
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
