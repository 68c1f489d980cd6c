"""Timing turns (`examples/timing_turns.py`, `benchmark.py --timing_turn`, `h200_pipeline.sh` ENGINE_TURNS=1):
processes that share a GPU warm up side by side and time one at a time, after all have warmed up."""

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from timing_turns import TimingTurn  # noqa: E402


def _slot(spec, warm_s, timed_s, log):
    """One process of a group, as a thread: warm up, wait for the turn, time, end."""
    turn = TimingTurn(spec, poll_s=0.01)
    time.sleep(warm_s)
    log.append(("ready", turn.slot, time.time()))
    info = turn.begin()
    start = time.time()
    time.sleep(timed_s)
    turn.end()
    log.append(("timed", turn.slot, start, time.time(), info))


def test_turns_wait_for_every_warm_up_and_do_not_overlap(tmp_path):
    """Three slots whose warm-ups end in reverse order: none times before the last warm-up ends, they time in slot
    order, their timed parts do not overlap, and a slot whose process dies before it is ready (no file of its own;
    its launcher marks it done) releases the others instead of holding them."""
    log = []
    group = [(0, 0.4), (1, 0.2), (2, 0.0)]  # (slot, warm-up seconds)
    threads = [threading.Thread(target=_slot, args=(f"{tmp_path}:{s}:4", w, 0.15, log)) for s, w in group]
    for t in threads:
        t.start()
    time.sleep(0.6)  # slot 3 never gets ready: its process died; nothing may have timed yet
    assert not [e for e in log if e[0] == "timed"]
    (tmp_path / "done.3").touch()  # what the launcher writes after the process has exited
    for t in threads:
        t.join(10)
    last_ready = max(e[2] for e in log if e[0] == "ready")
    timed = sorted((e for e in log if e[0] == "timed"), key=lambda e: e[2])
    assert [e[1] for e in timed] == [0, 1, 2]
    assert all(e[2] >= last_ready for e in timed)
    assert all(a[3] <= b[2] for a, b in zip(timed, timed[1:]))  # each starts after the one before ended
    info = timed[2][4]
    assert (info["slot"], info["of"]) == (2, 4) and info["turn_wait_s"] >= 0.25 and info["ended_at"] >= info["began_at"]


def test_turn_specs_are_checked_and_end_is_idempotent(tmp_path):
    for bad in ("nodir", f"{tmp_path}:3:3", f"{tmp_path}:-1:2", f"{tmp_path}:a:2", ":0:1"):
        with pytest.raises(ValueError, match="expected DIR:I:N"):
            TimingTurn(bad)
    turn = TimingTurn(f"{tmp_path / 'g'}:0:1")  # a group of one times at once
    turn.end()  # ended before it began (a failed row): marked done, nothing recorded
    assert (tmp_path / "g" / "done.0").exists() and turn.info is None
    assert turn.begin()["turn_wait_s"] < 1.0


def test_benchmark_processes_time_in_turns(tmp_path):
    """Two benchmark.py processes in one group on the tiny target: each row records its turn, the second timed after
    the first ended; a process with two rows is refused by name (its second row would compile during others' turns)."""
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "mtbench.jsonl").write_text("".join(json.dumps({"id": i, "input_ids": [3 + i, 7, 11]}) + "\n"
                                                   for i in range(2)))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    base = [sys.executable, str(ROOT / "examples" / "benchmark.py"), "--target", "tiny", "--datasets", "mtbench",
            "--prompts_dir", str(prompts), "--max_new_tokens", "6"]
    group = tmp_path / "turns"
    jobs = [subprocess.Popen(base + ["--methods", m, "--timing_turn", f"{group}:{i}:2", "--out", str(tmp_path / m)],
                             env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i, m in enumerate(["engine_ar", "hf_eager"])]
    outs = [j.communicate(timeout=300)[0] for j in jobs]
    assert [j.returncode for j in jobs] == [0, 0], outs
    rows = [json.loads((tmp_path / m / "bench.json").read_text())["results"] for m in ("engine_ar", "hf_eager")]
    (ar,), (hf,) = rows
    assert (ar["method"], hf["method"]) == ("engine_ar@1", "hf_eager")
    assert (ar["timing_turn"]["slot"], hf["timing_turn"]["slot"], hf["timing_turn"]["of"]) == (0, 1, 2)
    assert hf["timing_turn"]["began_at"] >= ar["timing_turn"]["ended_at"]
    assert sorted(p.name for p in group.iterdir()) == ["done.0", "done.1", "ready.0", "ready.1"]
    two = subprocess.run(base + ["--methods", "engine_ar", "hf_eager", "--timing_turn", f"{tmp_path / 'g2'}:0:1",
                                 "--out", str(tmp_path / "two")], env=env, cwd=tmp_path, capture_output=True,
                         text=True)
    assert two.returncode != 0
    assert re.search(r"--timing_turn times one row per process.*2 method\(s\) \(engine_ar@1, hf_eager\)", two.stderr)
    assert (tmp_path / "g2" / "done.0").exists()  # marked on the way out: a group would go on without it


def test_pipeline_runs_a_job_list_side_by_side_in_turns(tmp_path):
    """ENGINE_TURNS=1: `gjobs` (cut out of h200_pipeline.sh) starts every job of the list at once, each with its
    slot among the non-empty jobs, and marks each slot done once its job has ended, also one that failed."""
    text = (ROOT / "trainer" / "h200_pipeline.sh").read_text()
    body = re.search(r"^  gjobs\(\) \{.*?^  \}", text, re.S | re.M).group(0)
    harness = "\n".join([
        "set -euo pipefail", f"R={tmp_path}", "stamp=X", "ENGINE_TURNS=1",
        # a stand-in job: records its slot and start, the second fails without marking anything
        'ejob() { echo "$2 $TURN $(date +%s.%N)" >> "$R/started"; sleep 0.3; [ "$2" != 1 ]; }',
        body, 'gjobs 0 "a|x|mtbench|; ;b|y|mtbench|;c|z|mtbench|"', "echo finished"])
    r = subprocess.run(["bash", "-c", harness], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "finished" in r.stdout, r.stderr
    started = sorted(line.split() for line in (tmp_path / "started").read_text().splitlines())
    d = tmp_path / "turns_X_gpu0"
    assert [s[:2] for s in started] == [["0", f"{d}:0:3"], ["1", f"{d}:1:3"], ["2", f"{d}:2:3"]]
    assert max(float(s[2]) for s in started) - min(float(s[2]) for s in started) < 0.25  # side by side
    assert sorted(p.name for p in d.iterdir()) == ["done.0", "done.1", "done.2"]
