"""The type check: mypy with pyproject.toml's [tool.mypy] (strict on pipeline/core, mypy's
defaults elsewhere, no module exempt) passes on the package. CI runs
`make test` only, so the check runs here as well as in `make lint`. The cache lives under
.venv (or a temporary folder without one), so a rerun checks only what changed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _mypy(cache: Path, *targets: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache), *targets],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _cache(tmp_path: Path) -> Path:
    venv = REPO / ".venv"
    return venv / ".mypy_cache" if venv.is_dir() else tmp_path / "mypy_cache"


def test_the_package_type_checks(tmp_path):
    result = _mypy(_cache(tmp_path))
    assert result.returncode == 0, f"mypy found errors:\n{result.stdout}{result.stderr}"


def test_the_type_check_can_fail(tmp_path):
    module = tmp_path / "typed.py"
    module.write_text("def half(x: int) -> int:\n    return x / 2\n")
    result = _mypy(tmp_path / "mypy_cache", str(module))
    assert result.returncode == 1 and "Incompatible return value type" in result.stdout, (
        result.stdout + result.stderr
    )
