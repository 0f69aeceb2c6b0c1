"""The sync driver seam stays narrow (docs/contributing/feature-seam.md): no module of ``lightning_dist.sync`` reaches
the strategy (``.strategy``) or a private attribute of another object (``context._x``, ``trainer._x``: its own
``self._x`` only), nor replaces an optimizer's ``step``, nor logs by itself (its figures go through ``report()`` and
DistMetrics). Read with ``ast``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from lightning_dist.comm import CommStats
from lightning_dist.sync import SyncContext, SyncDriver, SyncSettings

SYNC = Path(__file__).resolve().parents[1] / "lightning_dist" / "sync"
MODULES = sorted(SYNC.glob("*.py"))


def _reaches(tree: ast.AST) -> list[str]:
    """Every ``.strategy``, every private attribute reached on anything but ``self`` or ``cls``, and every method of
    another object replaced (``optimizer.step = ...``: the strategy's ``step(closure, update)`` does that), with its
    line."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        replaced = isinstance(node.ctx, (ast.Store, ast.Del)) and node.attr == "step"
        if replaced and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            found.append(f"line {node.lineno}: {ast.unparse(node)} replaced")
        elif node.attr == "strategy":
            found.append(f"line {node.lineno}: .strategy")
        elif node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Name) and owner.id == "torch" and node.attr.startswith("_foreach_"):
                continue  # torch's foreach kernels (torch.optim's own), public in all but name
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return sorted(found)


@pytest.mark.parametrize("path", MODULES, ids=[p.name for p in MODULES])
def test_no_sync_module_reaches_the_strategy_or_a_private_attribute(path):
    assert _reaches(ast.parse(path.read_text())) == [], path.name


@pytest.mark.parametrize("path", MODULES, ids=[p.name for p in MODULES])
def test_no_driver_logs_by_itself(path):
    assert "log_metrics" not in path.read_text(), f"{path.name}: a driver's figures go through report() and DistMetrics"


def test_the_check_finds_what_it_looks_for():
    code = ("self.context.strategy.features\nx = context._trainer\nself._own = trainer._results\ncls._fine = 1\n"
            "optimizer.step = f\ndel optimizer.step\nself.step = 0\n")
    assert _reaches(ast.parse(code)) == ["line 1: .strategy", "line 2: context._trainer", "line 3: trainer._results",
                                         "line 5: optimizer.step replaced", "line 6: optimizer.step replaced"]


def test_the_context_carries_no_strategy_and_agrees_without_peers():
    context = SyncContext(rank=0, world_size=1, module=torch.nn.Linear(2, 2), topology=None,
                          algorithm="auto", timeout=None, stats=CommStats())
    assert not hasattr(context, "strategy") and not hasattr(context, "ddp")
    assert context.agree(True) is True and context.agree([False, True]) == [False, True]
    assert context.global_step == 0 and not context.fitting and not context.stopping  # no trainer attached


def test_settings_and_driver_are_apart_and_the_driver_has_twelve_hooks_at_most():
    hooks = [name for name in dir(SyncDriver) if not name.startswith("_")]
    assert len(hooks) <= 12, hooks
    assert not set(hooks) & {"describe", "check", "refuses", "bind"}
    assert {"describe", "check", "refuses", "bind", "name"} <= set(dir(SyncSettings))
