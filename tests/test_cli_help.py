"""Every command answers ``--help``: the console scripts of ``pyproject.toml`` and every ``python -m`` benchmark.

The console scripts run as a user runs them, each in a subprocess (the entry point pyproject names, called as the
wrapper pip installs calls it), all started at once so that their imports overlap. The benchmarks are found in the
package (every module under ``lightning_dist/benchmarks`` with a ``main`` or a ``__main__`` block; ``_``-modules are
helpers) and run in this process through :func:`runpy.run_module`, which is what ``python -m`` does, so that each
pays only for its own imports.
"""

import ast
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_dist.benchmarks

pytestmark = pytest.mark.subprocess_ok  # its subject is a --help in a subprocess
ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120.0  # a --help that takes longer hangs, on a machine whose 2 cores are shared
HYDRA_HELP = ("is powered by Hydra.", "== Configuration groups ==")  # a Hydra command's --help, its own format


def console_scripts() -> dict[str, str]:
    """``[project.scripts]``: command name -> ``module:function`` (read with a pattern: tomllib is Python 3.11+)."""
    section = re.search(r"^\[project\.scripts\]\n(.*?)(?=^\[|\Z)", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    assert section is not None, "pyproject.toml has no [project.scripts]"
    return dict(re.findall(r'^([\w.-]+)\s*=\s*"([\w.]+:\w+)"', section.group(1), re.M))


def _is_command(path: Path) -> bool:
    """A top-level ``main`` or ``if __name__ == "__main__":`` block makes a module a ``python -m`` command."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == "main":
            return True
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return True
    return False


def benchmark_commands() -> list[str]:
    package = Path(lightning_dist.benchmarks.__file__).parent
    return [f"lightning_dist.benchmarks.{path.stem}" for path in sorted(package.glob("*.py"))
            if not path.stem.startswith("_") and _is_command(path)]


def _looks_like_help(out: str) -> bool:
    return out.startswith("usage: ") or all(line in out for line in HYDRA_HELP)


@pytest.fixture(scope="module", autouse=True)
def script_help(tmp_path_factory):
    """Every console script's ``--help``, started at once before the first test, so that they run while the
    benchmarks' are checked in this process (in a scratch directory: nothing may be written there)."""
    cwd = tmp_path_factory.mktemp("cli_help")
    procs = {}
    try:
        for name, entry in console_scripts().items():
            module, function = entry.split(":")
            wrapper = f"import sys; from {module} import {function}; sys.argv[0] = {name!r}; sys.exit({function}())"
            procs[name] = subprocess.Popen([sys.executable, "-c", wrapper, "--help"], cwd=cwd, text=True,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        yield procs, cwd
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


def test_there_are_commands_to_check():
    assert {"lightning-dist-train", "lightning-dist-advise"} <= set(console_scripts())
    assert "lightning_dist.benchmarks.codecs" in benchmark_commands()


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # imported by an earlier test
@pytest.mark.parametrize("module", benchmark_commands())
def test_benchmark_answers_help(module, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    out = capsys.readouterr().out
    assert exited.value.code in (0, None), f"python -m {module} --help exited {exited.value.code}"
    assert out.startswith(f"usage: python -m {module}"), out[:1000]


@pytest.mark.parametrize("name", sorted(console_scripts()))
def test_console_script_answers_help(name, script_help):
    procs, cwd = script_help
    try:
        out, err = procs[name].communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} --help still runs after {TIMEOUT_S:.0f} s")
    assert procs[name].returncode == 0, f"{name} --help exited {procs[name].returncode}:\n{err[-3000:]}"
    assert _looks_like_help(out), f"{name} --help printed no usage:\n{out[:1000]}\n{err[-3000:]}"
    assert not any(cwd.iterdir()), f"{name} --help wrote {sorted(p.name for p in cwd.iterdir())}"
