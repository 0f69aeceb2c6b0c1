"""The suite's own rules, read off every test file's syntax tree (docs/contributing/tests.md, "What a test asserts").

Two shapes of assertion pass whatever the product does, and both were found in this suite:

- ``zip`` over two runs, compared pairwise: when one run is empty or cut short, ``zip`` stops at the shorter and the
  comparison passes on what is left (a resume that trained no step "equalled" the uninterrupted run). Every ``zip`` of
  two or more sequences in ``tests/`` says ``strict=True`` (a length mismatch raises); neighbours in one sequence are
  ``itertools.pairwise``.
- A lone lower bound at zero, ``x >= 0`` or ``0 <= x``: a time, a count or a byte total is never negative, so the
  check holds for a feature that does nothing. Bound it by what it must relate to (``0 <= exposed <= step``) or
  compare it with a reference.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

TESTS = pathlib.Path(__file__).parent


def _is_zero(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and not isinstance(node.value, bool) and node.value == 0


def _strict(call: ast.Call) -> bool:
    return any(k.arg == "strict" and isinstance(k.value, ast.Constant) and k.value.value is True
               for k in call.keywords)


def findings(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for every unchecked ``zip`` and every lone zero lower bound in an ``assert``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "zip"
                and len(node.args) >= 2 and not _strict(node)):
            found.append((node.lineno, "zip() of several sequences without strict=True"))
        if isinstance(node, ast.Assert):
            for compare in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
                if len(compare.ops) != 1:  # a chain such as 0 <= x <= bound has an upper bound
                    continue
                op, left, right = compare.ops[0], compare.left, compare.comparators[0]
                if (isinstance(op, ast.GtE) and _is_zero(right)) or (isinstance(op, ast.LtE) and _is_zero(left)):
                    found.append((compare.lineno, f"a lone lower bound: {ast.unparse(compare)}"))
    return sorted(found)


@pytest.mark.parametrize("source, expected", [
    ("assert all(a == b for a, b in zip(x, y))", ["zip() of several sequences without strict=True"]),
    ("assert all(a == b for a, b in zip(x, y, strict=False))", ["zip() of several sequences without strict=True"]),
    ("assert all(a == b for a, b in zip(x, y, strict=True))", []),
    ("pairs = dict(zip(names, values))", ["zip() of several sequences without strict=True"]),
    ("rows = list(zip(*columns))", []),  # one argument: a transpose, its lengths are the rows'
    ("assert m['exposed_ms'] >= 0", ["a lone lower bound: m['exposed_ms'] >= 0"]),
    ("assert all(t >= 0 for t in times)", ["a lone lower bound: t >= 0"]),
    ("assert 0 <= waited", ["a lone lower bound: 0 <= waited"]),
    ("assert 0 <= waited <= step", []),
    ("assert loss >= 0.5 and count > 0", []),
    ("x = [v for v in values if v >= 0]", []),  # not an assertion
])
def test_the_rules_find_what_they_name(source, expected):
    assert [what for _, what in findings(source)] == expected


def test_no_test_file_breaks_the_rules():
    broken = [f"{path.name}:{line}: {what}" for path in sorted(TESTS.glob("*.py"))
              for line, what in findings(path.read_text())]
    assert not broken, "\n".join(broken)
