"""The main job (scripts/train_demo.py, which ./scripts/run.sh runs): its compile seconds are
cold compiles unless asked otherwise, and its losses are checked against eager's."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--layers", "1", "--width", "64", "--vocab", "96", "--batch", "2", "--seq", "24", "--steps", "2",
        "--backends", "eager,boo"]


def _run(tmp_path, *extra):
    env = {**os.environ, "BOO_CACHE_DIR": str(tmp_path / "usual-boo"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "usual-inductor")}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_demo.py"), *TINY, *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "losses match" in proc.stdout, proc.stdout[-3000:]
    return proc.stdout


def _files(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()] if path.exists() else []


def test_the_main_job_compiles_into_empty_caches_of_its_own(tmp_path):
    out = _run(tmp_path)
    assert "compile caches: empty" in out
    assert _files(tmp_path / "usual-boo") == []  # the user's cache was neither read nor filled


def test_the_main_job_can_use_the_usual_caches(tmp_path):
    out = _run(tmp_path, "--caches", "shared")
    assert "compile caches: boo's and Inductor's usual ones" in out
    assert _files(tmp_path / "usual-boo")
