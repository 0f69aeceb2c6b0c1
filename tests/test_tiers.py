"""The fast tier guards itself: tests/conftest.py, run on a suite of its own (pytester, in this process), refuses
every way to launch in a test not marked slow, and lets the marked ones through."""

import os
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py")

INNER = '''
import multiprocessing
import subprocess

import pytest

from lightning_dist.testing import ToyClassifier, quiet_trainer


def test_a_subprocess():
    subprocess.run(["true"], check=True)


def test_a_process():
    multiprocessing.get_context("fork").Process(target=print).start()


def test_a_lightning_run():
    quiet_trainer(devices=1, max_steps=1).fit(ToyClassifier())


@pytest.fixture(scope="module")
def launched():
    subprocess.run(["true"], check=True)


def test_a_module_fixture_that_launches(launched):
    pass


@pytest.mark.subprocess_ok
def test_a_short_subprocess_when_it_says_so():
    subprocess.run(["true"], check=True)


@pytest.mark.subprocess_ok
def test_no_process_even_when_it_says_subprocess_ok():
    multiprocessing.get_context("fork").Process(target=print).start()


@pytest.mark.slow
def test_a_slow_test_may_launch():
    subprocess.run(["true"], check=True)
'''


@pytest.mark.subprocess_ok  # the inner slow and subprocess_ok tests run `true`
def test_the_fast_tier_refuses_launches_in_unmarked_tests(pytester):
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini("[pytest]\nmarkers =\n    slow: launches\n    subprocess_ok: a short subprocess\n")
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    outcomes = {report.nodeid.split("::")[-1]: report for report in result.reprec.getreports("pytest_runtest_logreport")
                if report.when == "call" or report.failed}
    refused = {name for name, report in outcomes.items() if report.failed and "LaunchInFastTier" in report.longreprtext}
    assert refused == {"test_a_subprocess", "test_a_process", "test_a_lightning_run",
                       "test_a_module_fixture_that_launches", "test_no_process_even_when_it_says_subprocess_ok"}
    assert outcomes["test_a_short_subprocess_when_it_says_so"].passed
    assert outcomes["test_a_slow_test_may_launch"].passed


def test_the_suite_forks_its_ranks_without_mkls_own_allocator():
    """tests/conftest.py turns MKL's allocator off before torch loads (docs/contributing/tests.md). With it on, ranks
    forked from a process that had run MKL on several threads spun forever at their first matrix product: 41 of 600
    forked children after the compressors' single-process emulations, 0 of 600 with it off."""
    assert os.environ.get("MKL_DISABLE_FAST_MM") == "1"
