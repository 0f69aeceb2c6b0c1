"""notebooks/*.ipynb: committed without outputs, and executed end to end on small settings.

Each notebook runs on a Jupyter kernel of this very environment (``python3``: ipykernel's kernel, which
jupyter_client starts with this interpreter) with ``LIGHTNING_DIST_NB_SMALL=1``, in a temporary directory.
A cell that runs past ``CELL_TIMEOUT_S`` fails the test; the kernel is then killed with its whole process group,
which holds the ranks Lightning forked from it, so nothing is left behind.
"""

import os
import sys
import time
from pathlib import Path

import nbformat
import psutil
import pytest
from nbclient import NotebookClient

from lightning_dist.testing import free_port, side_by_side

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 150  # the longest cell trains several 2-rank jobs: ~20 s on 2 cores with small settings
# the least each notebook must draw (a plot helper that silently draws nothing would otherwise pass)
MIN_FIGURES = {"01-quickstart.ipynb": 4, "02-compression.ipynb": 4, "03-heterogeneous.ipynb": 4,
               "04-sync-every-h.ipynb": 2}  # two figures of two panels each


def _execute(nb, cwd, env=None):
    # shutdown_kernel="immediate": at the end, or when a cell fails or times out, the kernel is killed at once
    # with its process group (jupyter_client starts it in a session of its own), forked ranks included, rather
    # than asked to shut down while a rank may be stuck in a collective. ``env``: the kernel's (default: ours)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", shutdown_kernel="immediate",
                            resources={"metadata": {"path": str(cwd)}})
    return client.execute(**({"env": env} if env is not None else {}))


def _gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_every_notebook_is_here():
    assert [p.name for p in NOTEBOOKS] == sorted(MIN_FIGURES)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs_and_with_a_parameters_cell(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    dirty = [i for i, cell in enumerate(code) if cell.outputs or cell.execution_count is not None]
    assert not dirty, f"{path.name}: code cells {dirty} hold outputs; clear them before committing"
    parameters = [cell for cell in code if "parameters" in cell.metadata.get("tags", [])]
    assert len(parameters) == 1 and "small_settings()" in parameters[0].source


@pytest.fixture(scope="module")
def kernel_run(tmp_path_factory):
    """One kernel serves both kernel tests: its Python, and a process it starts, to be gone once it is shut down."""
    cells = ["import sys; print(sys.prefix)",
             "import subprocess; child = subprocess.Popen(['sleep', '600']); print(child.pid)"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    _execute(nb, tmp_path_factory.mktemp("kernel"))
    return nb


@pytest.mark.slow  # starts a kernel
def test_the_kernel_runs_this_environments_python(kernel_run):
    assert kernel_run.cells[0].outputs[0].text.strip() == sys.prefix


@pytest.mark.slow  # starts a kernel
def test_processes_the_kernel_started_end_with_it(kernel_run):
    pid = int(kernel_run.cells[1].outputs[0].text)
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid), f"process {pid}, started by the kernel, outlived it"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """Every notebook executed on small settings, two at a time (:func:`~lightning_dist.testing.side_by_side`: a
    kernel's start and imports leave the second core idle), the longest first: name -> (the executed notebook, the
    error a cell raised or None, seconds). A failing notebook does not stop the others."""
    def run(path):
        tmp = tmp_path_factory.mktemp(path.stem)
        # the notebooks' run directories (tempfile.mkdtemp) go to TMPDIR; built here, inside the lane, so that the
        # kernel also carries side_by_side's tag (it kills every process a failing lane started); a port of its own
        # for the ranks its fits fork: two kernels each finding a free one at once can pick the same (free_port)
        env = {**os.environ, "LIGHTNING_DIST_NB_SMALL": "1", "TMPDIR": str(tmp), "MASTER_PORT": str(free_port()),
               "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
        nb = nbformat.read(path, as_version=4)
        started = time.perf_counter()
        try:
            _execute(nb, tmp, env)  # raises CellExecutionError, with the cell and its traceback, if any cell fails
        except Exception as err:  # noqa: BLE001 - reported by the notebook's own test
            return nb, err, time.perf_counter() - started
        return nb, None, time.perf_counter() - started

    longest_first = sorted(NOTEBOOKS, key=lambda p: p.name == "01-quickstart.ipynb")
    results = side_by_side(*(lambda p=p: run(p) for p in longest_first))
    return {p.name: result for p, result in zip(longest_first, results, strict=True)}


@pytest.mark.slow  # each trains 2-rank jobs forked from its kernel: 10-25 s on 2 cores
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_on_small_settings(path, executed):
    nb, error, elapsed = executed[path.name]
    if error is not None:
        raise error
    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    figures = sum(1 for out in outputs if "image/png" in out.get("data", {}))
    assert figures >= MIN_FIGURES[path.name], f"{path.name} drew {figures} figures"
    print(f"{path.name}: executed in {elapsed:.1f} s on {os.cpu_count()} cores")
