"""Turns for timing: benchmark processes on one GPU warm up (compile) side by side and time one at a time.

Why: a compiled engine row spends 88-98 % of its device time compiling: 120-171 s a row against 1-8 s of timed
decoding on an H100 (`examples/results/h100-2026-12-07i`, `-07j`). Compiling is host work (Dynamo, AOTAutograd,
inductor, Triton's compiler on the host's cores; the H100 and H200 hosts have 16), so rows compiled side by side in
processes of their own should cost little more device time than one compile, where rows of one process cost one
compile each (not yet measured on a GPU). Their timed parts must not overlap anything else
on the GPU or the host, so each process, once warmed up, waits until every process has warmed up (or ended), and
then times in slot order while the others wait idle.

The protocol is a file per event in a directory shared by the N processes of a group: `ready.I` when slot I has
warmed up, `done.I` when its timed part has ended. Slot I times once every slot has `ready` or `done` and every slot
below I has `done`. A process writes `done` itself (also when it fails), and its launcher writes it again after the
process has exited (`trainer/h200_pipeline.sh`, ENGINE_TURNS=1), so that a crashed or killed process releases the
others instead of leaving them waiting until their own time box ends.

What it does not control: the processes' warm-ups overlap one another on the GPU, inductor's benchmarking of
kernel configurations included (24-64 kernels a row were benchmarked in `-07j`), so a row's kernels may be chosen
under load. A row timed in a group should be compared with the same row timed alone before groups are trusted for
differences of a few per cent.
"""

from __future__ import annotations

import time
from pathlib import Path


class TimingTurn:
    """Slot `I` of a group of `N` processes sharing directory `DIR`, from the spec "DIR:I:N"."""

    def __init__(self, spec: str, poll_s: float = 0.05):
        try:
            where, slot, count = spec.rsplit(":", 2)
            self.slot, self.count = int(slot), int(count)
        except ValueError:
            raise ValueError(f"timing turn {spec!r}: expected DIR:I:N (slot I of N processes, 0 <= I < N)") from None
        if not (where and 0 <= self.slot < self.count):
            raise ValueError(f"timing turn {spec!r}: expected DIR:I:N (slot I of N processes, 0 <= I < N)")
        self.dir = Path(where)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.poll_s = poll_s
        self.info: dict | None = None  # what `begin` waited for, and when the turn began and ended (wall clock)

    def _has(self, event: str, slot: int) -> bool:
        return (self.dir / f"{event}.{slot}").exists()

    def _mark(self, event: str) -> None:
        (self.dir / f"{event}.{self.slot}").touch()

    def begin(self) -> dict:
        """Mark this slot warmed up and return when its turn to time has come (once; later calls return at once)."""
        if self.info is not None:
            return self.info
        self._mark("ready")
        t0 = time.time()
        while not all(self._has("ready", j) or self._has("done", j) for j in range(self.count)):
            time.sleep(self.poll_s)
        t1 = time.time()
        while not all(self._has("done", j) for j in range(self.slot)):
            time.sleep(self.poll_s)
        t2 = time.time()
        self.info = {"slot": self.slot, "of": self.count, "barrier_wait_s": round(t1 - t0, 2),
                     "turn_wait_s": round(t2 - t1, 2), "began_at": t2}
        return self.info

    def end(self) -> None:
        """Mark this slot's timed part ended (the next slot may time). Idempotent; also right when nothing was
        timed (a failed row), so that the group goes on."""
        if self.info is not None and "ended_at" not in self.info:
            self.info["ended_at"] = time.time()
        self._mark("done")
