"""`trainer/h200_pipeline.sh`'s GGUF join, run in bash on CPU: the GPU calls rebuild the reference target from two
carried halves, and a half that is missing or wrong must stop the call without leaving a file that a later call takes
for the target (2026-12-02d: an empty GGUF did)."""

import hashlib
import re
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "trainer" / "h200_pipeline.sh"


def _join(tmp_path, part0: bytes | None, part1: bytes, md5: str):
    """Run the script's own join_gguf (cut out of the file) in a harness with set -euo pipefail, as the script runs
    it: `have_target || join_gguf`. pip is stubbed. Returns (exit code, whether the GGUF exists, output)."""
    body = re.search(r"^join_gguf\(\) \{.*?^\}", SCRIPT.read_text(), re.S | re.M).group(0)
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
    body = re.search(r"^call_box\(\) \{.*?^\}", SCRIPT.read_text(), re.S | re.M).group(0)
    harness = "\n".join(["set -euo pipefail", 'log() { echo "[log] $*"; }', body,
                         "SECONDS=500; echo $(call_box 570) $(call_box 60)", "SECONDS=599; echo $(call_box 30)",
                         "CALL_SECONDS=900; SECONDS=500; echo $(call_box 300)"])
    r = subprocess.run(["bash", "-c", harness], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:3] == ["85 60", "1", "300"], r.stdout
    assert "time box 570 s cut to 85 s" in r.stderr  # the log line goes to stderr, not into the box
    # every time box of the script goes through it
    boxes = re.findall(r"timeout (?:-k \d+ )?(\S+)", SCRIPT.read_text())
    assert len(boxes) >= 20 and all(b == "$(call_box" for b in boxes), boxes
