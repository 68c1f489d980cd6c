"""`CarryoverTrainer`: a thin `transformers.Trainer` subclass for drafters (TRL's layout: config + trainer).

Why a subclass and not a custom loop: users get Trainer's checkpointing/resume, logging, accelerate/DDP/FSDP,
gradient accumulation and LR schedules for free. What it adds: the frozen target (held here, *outside* the
drafter's module tree, so DDP/FSDP wrap and save only the drafter) and `compute_loss` = the stage-1 or
stage-2 objective of `objectives.py`. Per-position accuracy is logged with the loss, on train and held-out data.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from transformers import Trainer, TrainingArguments

from .objectives import stage1_loss, stage2_loss


@dataclass
class CarryoverTrainingArguments(TrainingArguments):
    """TrainingArguments plus the drafter objective's knobs."""

    stage: int = field(default=1, metadata={"help": "1: parallel-anchor baseline; 2: draft-verify-draft Carryover."})
    num_anchors: int = field(default=512, metadata={"help": "Anchors per sequence (stage 2: per draft pass)."})
    l1_weight: float = field(default=0.0, metadata={"help": "DSpark: loss = (1-w) CE + w ||p_d - p_t||_1 (stage 1, "
                                                            "and every term of stage 2)."})
    carry_chain: int = field(default=1, metadata={"help": "Stage 2: chain steps of draft-with-rows -> verify before "
                                                          "the trained drafts (1: rows of a row-free draft only)."})
    attn_backend: str = field(default="sdpa", metadata={"help": "'sdpa' (dense boolean mask) or 'flex'."})
    carry_gate_lr_multiplier: float = field(default=50.0, metadata={
        "help": "Stage 2: the carryover gate's learning rate is this multiple of the rest's. The gate is a few dozen "
                "logit biases that must travel several units within a short run; at the drafter's LR they would "
                "move ~LR per step (Adam) and never open."})
    max_seq_len: int = field(default=1024, metadata={"help": "Sequences are cut to this many tokens."})
    remove_unused_columns: bool = False


class CarryoverTrainer(Trainer):
    def __init__(self, model=None, args: CarryoverTrainingArguments = None, target=None, **kwargs):
        if target is None:
            raise ValueError("CarryoverTrainer needs the frozen `target` whose hidden states the drafter reads.")
        if args.stage == 2 and not model.config.carryover:
            raise ValueError("Stage 2 trains Carryover: load/build the drafter with carryover=True.")
        if args.stage not in (1, 2):
            raise ValueError(f"Unknown stage {args.stage}; expected 1 or 2.")
        if args.carry_chain < 1:
            raise ValueError(f"carry_chain={args.carry_chain}: stage 2 needs at least one draft-verify step "
                             "(1 or more).")
        if args.n_gpu > 1:  # one process that sees several GPUs: Trainer would wrap the drafter in DataParallel
            raise ValueError(
                f"This one training process sees {args.n_gpu} GPUs, so transformers' Trainer would run torch "
                f"DataParallel over them: the batch grows {args.n_gpu}x (per_device_train_batch_size x {args.n_gpu}) "
                "while the frozen target stays on one GPU. Start one process per GPU (`accelerate launch "
                f"--num_processes {args.n_gpu} --multi_gpu trainer/train.py ...`) or pick one GPU "
                "(`CUDA_VISIBLE_DEVICES=0`).")
        super().__init__(model=model, args=args, **kwargs)
        self.model_accepts_loss_kwargs = False  # our loss is already a mean
        self.target = target.to(self.args.device).eval().requires_grad_(False)
        model.bind_target(self.target)
        self._metric_buf = defaultdict(list)

    def create_optimizer(self, *args, **kwargs):
        """transformers' optimizer, with the carryover gate (if the drafter has one) moved out of its group into
        one of its own at `carry_gate_lr_multiplier` x that group's learning rate and no weight decay; the LR
        schedule, built afterwards, scales every group alike."""
        opt = super().create_optimizer(*args, **kwargs)
        gate = getattr(self.model, "carryover_gate", None)
        mult = self.args.carry_gate_lr_multiplier
        moved = any(g.get("carryover_gate") for g in opt.param_groups)  # a second call finds it done
        if gate is None or not gate.requires_grad or mult == 1.0 or moved:
            return opt
        for group in opt.param_groups:
            if any(p is gate for p in group["params"]):
                group["params"] = [p for p in group["params"] if p is not gate]
                opt.add_param_group({"params": [gate], "lr": group["lr"] * mult, "weight_decay": 0.0,
                                     "carryover_gate": True})
                break
        return opt

    def _objective(self, model, inputs):
        drafter = self.accelerator.unwrap_model(model)
        drafter.bind_target(self.target)
        fn = stage1_loss if self.args.stage == 1 else stage2_loss
        kw = {"l1_weight": self.args.l1_weight}
        if self.args.stage == 2:
            kw["chain"] = self.args.carry_chain
        return fn(model, drafter, self.target, inputs, num_anchors=self.args.num_anchors,
                  backend=self.args.attn_backend, **kw)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, metrics = self._objective(model, inputs)
        for key, value in metrics.items():
            self._metric_buf[key].append(value)
        return (loss, None) if return_outputs else loss

    def log(self, logs, *args, **kwargs):
        if "loss" in logs and self._metric_buf:
            logs.update(_reduce(self._metric_buf, prefix="train_"))
            self._metric_buf.clear()
            if torch.cuda.is_available():  # sizes the next run's batch: the H200 runs pick it from this
                logs["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        super().log(logs, *args, **kwargs)

    @torch.no_grad()
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        """Held-out loss and per-position accuracy with the training objective (no parameter update)."""
        loader = self.get_eval_dataloader(eval_dataset)
        self.model.eval()
        buf, losses = defaultdict(list), []
        for inputs in loader:
            inputs = self._prepare_inputs(inputs)
            with self.compute_loss_context_manager():  # same autocast as training
                loss, metrics = self._objective(self.model, inputs)
            losses.append(float(loss))
            for key, value in metrics.items():
                buf[key].append(value)
        local = torch.tensor([sum(losses), len(losses)], device=self.args.device, dtype=torch.float64)
        total = self.accelerator.reduce(local, reduction="sum")
        out = {f"{metric_key_prefix}_loss": float(total[0] / total[1].clamp(min=1))}
        # every process evaluated its own shard of the held-out set: the metrics pool all of them, like the loss
        out.update(_reduce(buf, prefix=f"{metric_key_prefix}_",
                           allsum=lambda t: self.accelerator.reduce(t.to(self.args.device), reduction="sum").cpu()))
        self.log(out)
        self.model.train()
        return out


def _reduce(buf, prefix, allsum=None):
    """Mean over batches of scalar metrics (NaNs skipped) and element-wise mean (rounded) of per-position lists.
    `allsum` sums a float64 tensor over processes (data-parallel evaluation); each process must hold the same keys."""
    out = {}
    for key, values in buf.items():
        if isinstance(values[0], list):  # [sum per column..., number of batches]
            cols = [sum(c) for c in zip(*values)]
            t = torch.tensor(cols + [len(values)], dtype=torch.float64)
        else:
            vals = [v for v in values if v == v]
            t = torch.tensor([sum(vals), len(vals)], dtype=torch.float64)
        if allsum is not None:
            t = allsum(t)
        n = float(t[-1])
        if isinstance(values[0], list):
            out[prefix + key] = [round(float(c) / n, 4) for c in t[:-1]]
        else:
            out[prefix + key] = round(float(t[0]) / n, 5) if n else float("nan")
    return out


__all__ = ["CarryoverTrainer", "CarryoverTrainingArguments"]
