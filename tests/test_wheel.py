"""What users install is a wheel, not this checkout: build it, install it where the checkout cannot be seen, import
every module of it and run a short fit of the default job from it.

"Cannot be seen": a fresh virtual environment (no pip, no editable install's import finder, no ``.pth`` of the test
environment's processed) whose one ``.pth`` line puts the test environment's site-packages on the path for the
dependencies (torch, Lightning, Hydra ...), and a working directory outside the checkout. The training command's
ranks are re-run by Lightning's launcher with the same interpreter, so they see the same (installed) package.
"""

import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import importlib, json, pkgutil, sys
import lightning_dist
assert not any("editable" in type(finder).__name__.lower() or "editable" in getattr(finder, "__name__", "").lower()
               for finder in sys.meta_path), sys.meta_path
modules = sorted(m.name for m in pkgutil.walk_packages(lightning_dist.__path__, "lightning_dist."))
files = {name: importlib.import_module(name).__file__ for name in ["lightning_dist", *modules]}
print(json.dumps(files))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh environment holding the built wheel: (its python, a working directory outside the checkout)."""
    root = tmp_path_factory.mktemp("wheel")
    wheel_dir, env_dir, work = root / "dist", root / "env", root / "work"
    work.mkdir()
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(wheel_dir), str(REPO)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = wheel_dir.glob("lightning_dist-*.whl")
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
    python = env_dir / "bin" / "python"
    env_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    # the dependencies only: a .pth line adds a directory to the path without processing that directory's own .pth
    # files, so the test environment's editable finder for this checkout never loads
    Path(env_site, "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "-q",
                                "--target", env_site, str(wheel)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    return python, Path(env_site), work


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    return {**env, "PYTHONNOUSERSITE": "1"}


@pytest.mark.slow  # a wheel build, an install and a fit
def test_the_wheel_imports_every_module_from_its_install(installed):
    python, site, work = installed
    proc = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, cwd=work, env=_clean_env(),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = json.loads(proc.stdout.strip().splitlines()[-1])
    in_checkout = sorted(name for name, file in files.items() if not file.startswith(str(site)))
    assert not in_checkout, f"imported from outside the installed wheel: {in_checkout}"
    # every subpackage of the checkout ships (discovered, not listed), the Hydra configs included
    packages = {".".join(p.relative_to(REPO).parent.parts) for p in (REPO / "lightning_dist").rglob("__init__.py")}
    assert packages <= set(files), sorted(packages - set(files))
    assert (site / "lightning_dist" / "conf" / "config.yaml").is_file()
    assert (site / "lightning_dist" / "conf" / "sync" / "diloco.yaml").is_file()


@pytest.mark.slow  # a wheel build, an install and a fit
def test_the_installed_default_job_trains(installed):
    python, site, work = installed
    run_dir = work / "run"
    # the README's main job from the installed package, one epoch instead of ten
    proc = subprocess.run([str(python), "-m", "lightning_dist.train", f"hydra.run.dir={run_dir}",
                           "trainer.max_epochs=1", "trainer.enable_progress_bar=false"],
                          capture_output=True, text=True, cwd=work, env=_clean_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["epochs"] == 1
    assert summary["metrics"]["val/acc"] > 0.5, summary["metrics"]
