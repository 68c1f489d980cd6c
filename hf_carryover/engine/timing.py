"""Phase timing of engine rounds and the latency model it feeds (`examples/benchmark.py --profile`).

The clock synchronises the device around the draft and verify phases, which a captured or compiled round cannot do,
so profiling runs the rounds eagerly: its figures split an eager round's time, for the latency model's check of
predicted against measured speedup.
"""

from __future__ import annotations

import time

import torch


class PhaseClock:
    """Phase timer for `profile=True` (synchronising, so only for measurement runs); a no-op otherwise."""

    def __init__(self, enabled, device, totals):
        self.enabled, self.device, self.totals = enabled, device, totals
        self.t = 0.0

    def _now(self):
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self):
        if self.enabled:
            self.t = self._now()
            self.totals["rounds"] += 1

    def lap(self, phase):
        if self.enabled:
            now = self._now()
            self.totals[phase] += now - self.t
            self.t = now


def predicted_speedup(tau: float, t_draft: float, t_verify: float, t_ar_step: float) -> float:
    """Latency model: tokens per second of speculative decoding over plain decoding,
    (τ / (T_draft + T_verify)) / (1 / T_ar_step); with T_ar_step ≈ T_verify it is τ·T_verify/(T_draft+T_verify)."""
    return tau * t_ar_step / (t_draft + t_verify)
