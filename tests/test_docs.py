"""The documentation: the README stays a front page, every page is in the site's nav, the site builds in strict mode,
each measured figure is said once, and what the pages list (Hydra's options, Lightning's private API) is the code's.

The strict build (``mkdocs build --strict``, configured in ``mkdocs.yml``) fails on a broken link or anchor, a page
left out of the nav, an API reference to a name that does not exist, or a docstring that does not render.

**Each figure said once.** A measured figure lives on the benchmarks page, tagged with a name:
``<span id="fig-onebit-bytes">1/26.7</span>``. Any other statement of it, on any page or the README, is a quote: a
link to that name whose text is the value, ``[1/26.7](benchmarks.md#fig-onebit-bytes)`` (``#fig-...`` on the
benchmarks page itself). The tests below check every quote against its tag, and look on every page for the tagged
figures stated again outside a quote, in the same or in a rounded or truncated form ("26x", "1/27").
"""

import importlib.util
import re
import subprocess
import sys
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import NamedTuple, Optional

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
FIGURE_HOME = DOCS / "benchmarks.md"  # where measured figures are tagged
FIGURE_TAG = re.compile(r'<span id="(fig-[a-z0-9-]+)">([^<]*)</span>')
FIGURE_QUOTE = re.compile(r"\[([^\]]*)\]\((?:(?:docs/)?benchmarks\.md)?#(fig-[a-z0-9-]+)\)")
# a figure with a unit: a sign, "1/" for a fraction, the number, then "%", "x fewer" (a fraction too), "x" or " pt"
FIGURE = re.compile(r"(?<![\w.,/])([+\-−]?)(1/)?(\d+(?:,\d{3})*(?:\.\d+)?)(%|x fewer\b|x\b| pts?\b| points?\b)?")


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


def _pages() -> list[Path]:
    """Every page a user reads: the README and every page of the site."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def _prose(text: str) -> list[str]:
    """``text``'s lines with what states no figure of ours blanked: fenced code (a benchmark's raw output, commands),
    inline code, HTML comments and snippet lines. Line numbers are kept."""
    text = re.sub(r"<!--.*?-->", lambda m: "\n" * m.group().count("\n"), text, flags=re.S)
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            lines.append("")
        elif fenced or line.lstrip().startswith("--8<--"):
            lines.append("")
        else:
            lines.append(re.sub(r"`[^`]*`", "", line))
    return lines


class Figure(NamedTuple):
    unit: str  # "%", "1/" ("1/26.7", "26.7x fewer"), "x", "pt" or "" (none: only quoted, never searched for)
    sign: str
    value: Decimal  # unsigned


def _figure(text: str) -> Optional[Figure]:
    match = FIGURE.fullmatch(text.strip())
    if match is None:
        return None
    sign, fraction, number, unit = match.groups()
    kind = "1/" if fraction or unit == "x fewer" else {"%": "%", "x": "x", None: ""}.get(unit, "pt")
    return Figure(kind, sign.replace("−", "-"), Decimal(number.replace(",", "")))


def _states(figure: Figure, said: Figure) -> bool:
    """Whether ``said`` (a number on a page) is ``figure`` again: the same digits with the same unit, or the number
    rounded to one decimal less, either way at a half, where that keeps 3 significant digits ("+34.7%" for +34.65%,
    "26.7x fewer" for 1/26.7). Coarser roundings ("1/27", "-2.2%") are left alone: such numbers are everywhere,
    meaning other things; a figure is written with its tag's digits or quoted."""
    if said.unit != figure.unit or not figure.unit or (said.sign and figure.sign and said.sign != figure.sign):
        return False
    if said.value.as_tuple() == figure.value.as_tuple():
        return True
    decimals = -said.value.as_tuple().exponent
    if decimals != -figure.value.as_tuple().exponent - 1 or len(said.value.as_tuple().digits) < 3:
        return False
    step = Decimal(1).scaleb(-decimals)
    return any(figure.value.quantize(step, rounding=mode) == said.value for mode in (ROUND_HALF_UP, ROUND_HALF_EVEN))


def _tags() -> list[tuple[str, int, str, str]]:
    """Every tagged figure on every page: (page, line, name, value)."""
    return [(str(page.relative_to(ROOT)), number, name, value) for page in _pages()
            for number, line in enumerate(page.read_text().splitlines(), 1)
            for name, value in FIGURE_TAG.findall(line)]


def _quotes() -> list[tuple[str, int, str, str]]:
    """Every quote of a tagged figure on every page: (page, line, name, text)."""
    return [(str(page.relative_to(ROOT)), number, name, text.strip("*")) for page in _pages()
            for number, line in enumerate(page.read_text().splitlines(), 1)
            for text, name in FIGURE_QUOTE.findall(line)]


def test_figures_are_tagged_once_on_the_benchmarks_page():
    tags = _tags()
    assert len(tags) >= 20, f"only {len(tags)} figures tagged on {FIGURE_HOME.name}: the check below would be empty"
    elsewhere = [f"{page}:{line} {name}" for page, line, name, _ in tags if page != str(FIGURE_HOME.relative_to(ROOT))]
    assert not elsewhere, f"figures are tagged on {FIGURE_HOME.name} only (quote them elsewhere): {elsewhere}"
    seen: dict[str, str] = {}
    twice = [f"{name} = {value} at line {line}, and {seen[name]}" for _, line, name, value in tags
             if seen.setdefault(name, f"{value} at line {line}") != f"{value} at line {line}"]
    assert not twice, f"a figure tagged twice (quote it the second time: [value](#name)): {twice}"
    unreadable = [f"{name} = {value!r}" for _, _, name, value in tags if _figure(value) is None]
    assert not unreadable, f"a tag holds one number and its unit (%, x, 1/N, pt), nothing else: {unreadable}"


def test_every_quoted_figure_is_its_tagged_value():
    tags = {name: value for _, _, name, value in _tags()}
    quotes = _quotes()
    assert any(page == "README.md" for page, *_ in quotes), "the README quotes no figure (its headline figures must)"
    wrong = [f"{page}:{line} quotes {name} as {text!r}, tagged {tags[name]!r}" if name in tags else
             f"{page}:{line} quotes {name}, which no page tags" for page, line, name, text in quotes
             if tags.get(name) != text]
    assert not wrong, "a quoted figure differs from its source:\n" + "\n".join(wrong)


def test_no_figure_is_stated_with_two_values():
    """A tagged figure stated again without its link, as it is or rounded ("26x", "1/27", "+34.7%"), is a second
    statement that can drift from the first; the same figure with a different number is the drift itself."""
    tagged = [(name, value, figure) for _, _, name, value in _tags() if (figure := _figure(value)) and figure.unit]
    restated = []
    for page in _pages():
        for number, line in enumerate(_prose(page.read_text()), 1):
            line = FIGURE_QUOTE.sub("", FIGURE_TAG.sub("", line))
            for match in FIGURE.finditer(line):
                said = _figure(match.group())
                restated += [f"{page.relative_to(ROOT)}:{number} states {match.group()!r}: quote {name} as "
                             f"[{value}]({'docs/' if page == README else ''}benchmarks.md#{name})"
                             for name, value, figure in tagged if said and _states(figure, said)]
    assert not restated, "figures stated outside their quote:\n" + "\n".join(restated)


def test_a_figure_is_told_from_another_by_its_digits():
    """What the check above counts as the same figure (its own test: the scan itself must be able to fail)."""
    bytes_ = _figure("1/26.7")
    assert [said for said in ("27x fewer", "1/27", "26.7x fewer", "1/26.7", "1/25.8", "26.7x", "1/2.67", "1/26.70")
            if _states(bytes_, _figure(said))] == ["26.7x fewer", "1/26.7"]
    topk = _figure("+34.65%")
    assert [said for said in ("+34.7%", "34.6%", "35%", "+34.65%", "+47.2%", "-34.7%", "34.65 pt", "34.650%") if
            _states(topk, _figure(said))] == ["+34.7%", "34.6%", "+34.65%"]
    assert [said for said in ("+4.6%", "4.59%", "4.5%") if _states(_figure("+4.59%"), _figure(said))] == ["4.59%"]
    small = _figure("-0.44%")
    assert [said for said in ("-0.44%", "0.44%", "-0.4%", "-0.51%", "0%", "+0.44%") if
            _states(small, _figure(said))] == ["-0.44%", "0.44%"]
    assert [m.group() for m in FIGURE.finditer("16-39 passes, +1.13% and 2.5x, 1/50.0 at 1,600 steps, v2.6")] == [
        "16", "39", "+1.13%", "2.5x", "1/50.0", "1,600"]


def test_the_hydra_page_lists_every_option_of_every_group():
    """docs/hydra.md's table of config groups names every option Hydra offers (the YAML files under
    lightning_dist/conf/<group>/), and no other."""
    conf = ROOT / "lightning_dist" / "conf"
    groups = {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in conf.iterdir() if d.is_dir() and
              any(d.glob("*.yaml"))}
    assert {"compression", "sync", "callbacks"} <= set(groups)
    rows = re.findall(r"^\| `([a-z_]+)` \| (.*?) \|", (DOCS / "hydra.md").read_text(), flags=re.M)
    listed = {group: sorted(re.findall(r"`([a-z0-9_]+)`", options)) for group, options in rows}
    assert listed == groups, f"hydra.md's groups table differs from lightning_dist/conf/: page {listed}, conf {groups}"


def test_the_strategy_page_gives_the_lightning_pin_and_why():
    """The pin on Lightning (pyproject.toml) is there for its private API: docs/strategy.md states the pin and names
    every private name the package reaches (through lightning_dist.upstream alone)."""
    pin = re.search(r'"(lightning[<>=!,.\d]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    text = (DOCS / "strategy.md").read_text()
    assert f"`{pin}`" in text, f"docs/strategy.md does not give the pin {pin} (pyproject.toml)"
    from lightning_dist.upstream import REACHED  # the one list (tests/test_upstream.py: no other module reaches one)

    names = {name for _, name in REACHED}
    missing = sorted(name for name in names if f"{name}`" not in text)
    assert not missing, f"docs/strategy.md's list of Lightning's private names lacks {missing}"


# 5-14 s on 2 shared cores (the API reference reads the whole package): the slow tier, which CI runs
def test_the_advise_pages_accuracy_table_is_the_one_advise_reads():
    """docs/advise.md shows ACCURACY_COST (lightning-dist-advise's one copy: product data the compression benchmark
    writes) row for row: the page cannot drift from what the command prints."""
    from lightning_dist.compression.accuracy import ACCURACY_COST

    text = (DOCS / "advise.md").read_text()
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
