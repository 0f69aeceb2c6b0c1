"""``ruff check`` is clean on the package and the tests (rules and line length in ``pyproject.toml``)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    """The ruff of this environment (the test extra installs it), else one on the PATH, else none."""
    beside = Path(sys.executable).with_name("ruff")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("ruff")
    return [found] if found else []


@pytest.mark.subprocess_ok
def test_ruff_check_is_clean():
    ruff = _ruff()
    if not ruff:
        pytest.skip('ruff is not installed: pip install -e ".[test]"')
    out = subprocess.run([*ruff, "check", "lightning_dist", "tests"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, "ruff check found problems:\n" + out.stdout + out.stderr
