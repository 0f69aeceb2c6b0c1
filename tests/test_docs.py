"""The documentation: the README stays a front page, every page is in the site's nav, the site builds in strict mode.

The strict build (``mkdocs build --strict``, configured in ``mkdocs.yml``) fails on a broken link or anchor, a page
left out of the nav, an API reference to a name that does not exist, or a docstring that does not render.
"""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 300
# a fresh machine's two commands; CI runs the second (.ci/run)
FRESH_MACHINE_COMMANDS = (
    "bash scripts/setup.sh && .venv/bin/lightning-dist-train",
    "bash scripts/setup.sh && .venv/bin/python -m pytest -q",
)
BUILD_TIMEOUT_S = 300


def _nav_pages(nav) -> list[str]:
    """Every page path in an mkdocs ``nav`` (nested lists of ``{title: page or [...]}``)."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for entry in nav for page in _nav_pages(entry)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    return []


def _mkdocs_nav() -> list[str]:
    # mkdocs.yml may hold python tags (!!python/name:...) in other projects; ours is plain YAML
    import yaml

    return _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to a page under docs/"


@pytest.mark.parametrize("command", FRESH_MACHINE_COMMANDS)
def test_readme_keeps_the_fresh_machine_commands(command):
    text = README.read_text()
    assert text.count(command) == 1, f"README.md must hold `{command}` exactly once (CI and new users run it)"


def test_readme_links_resolve():
    text = README.read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]
    assert any(t.startswith("docs/") for t in local), "the README links to no page of the docs"
    missing = [t for t in local if t and not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_every_page_is_in_the_nav():
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    nav = _mkdocs_nav()
    assert not pages - set(nav), f"pages in docs/ missing from mkdocs.yml's nav: {sorted(pages - set(nav))}"
    assert not set(nav) - pages, f"mkdocs.yml's nav names missing pages: {sorted(set(nav) - pages)}"


# 5-14 s on 2 shared cores (the API reference reads the whole package): the slow tier, which CI runs
def test_the_compression_pages_accuracy_table_is_the_one_advise_reads():
    """docs/compression.md shows ACCURACY_COST (lightning-dist-advise's one copy: product data the compression benchmark
    writes) row for row: the page cannot drift from what the command prints."""
    from lightning_dist.compression.accuracy import ACCURACY_COST

    text = (DOCS / "compression.md").read_text()
    table = text[text.index("| compressor | settings | points vs dense | val acc |"):].split("\n\n")[0]
    rows = [[cell.strip().strip("`") for cell in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    assert [(name, float(points), acc) for name, _, points, acc in rows] == [
        (name, cost, note.split(": ")[-1].split()[-1]) for name, _, cost, note in ACCURACY_COST]


@pytest.mark.slow
def test_site_builds_in_strict_mode(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings_handlers") is None:
        pytest.skip('the docs extra is not installed: pip install -e ".[docs]"')
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    problems = [line for line in out.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert out.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(problems or out.stderr.splitlines()[-30:])
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "reference" / "index.html").exists()
