"""Every private name of Lightning and torch the package reaches (``lightning_dist.upstream.REACHED``) still exists
where it is reached, and Lightning still calls the hooks the package overrides: a Lightning release that moves one
fails here, by name, before it fails a fit. No process group, no fit."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.loops.optimization.automatic import Closure
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.profilers import PyTorchProfiler
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

import lightning_dist
from lightning_dist import RingDDPStrategy
from lightning_dist.profiling import AllThreadsProfiler
from lightning_dist.testing import quiet_trainer
from lightning_dist.upstream import REACHED, DDPBase, ProfilerBase

PACKAGE = pathlib.Path(lightning_dist.__file__).parent


def _owner(path: str):
    """The module at ``path``, or the attribute its last part names in the module before it."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        module, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module), name)


@pytest.fixture(scope="module")
def live():
    """A live object of every class whose instances carry a reached attribute (a Trainer is built, not run)."""
    trainer = quiet_trainer(max_steps=1)
    module = pl.LightningModule()
    return {DDPStrategy: DDPStrategy(), PyTorchProfiler: PyTorchProfiler(), pl.LightningModule: module,
            pl.Trainer: trainer, _FitLoop: trainer.fit_loop, _TrainingEpochLoop: trainer.fit_loop.epoch_loop}


@pytest.mark.parametrize("owner, name", REACHED, ids=[f"{o.rsplit('.', 1)[-1]}.{n}" for o, n in REACHED])
def test_every_reached_private_name_is_still_there(live, owner, name):
    found = _owner(owner)
    where = live.get(found, found) if inspect.isclass(found) else found
    assert hasattr(where, name), f"{owner}.{name} is gone in this release: lightning_dist.upstream reaches it"


def test_lightning_still_calls_the_hooks_the_adapter_turns_public():
    # If Lightning renames or stops calling these, our comm hook, launcher choice or profiler switch would be skipped
    # silently
    assert "self._register_ddp_hooks()" in inspect.getsource(DDPStrategy.configure_ddp)
    assert "self.strategy._configure_launcher()" in inspect.getsource(_AcceleratorConnector)
    assert "self._create_profiler(" in inspect.getsource(PyTorchProfiler)
    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(_TrainingEpochLoop.advance)
    # MicroBatches runs the later micro-batches from backward because Lightning's closure zeroes the gradients after
    # training_step: if the order changes, the design must change with it
    source = inspect.getsource(Closure.closure)
    assert source.index("self._step_fn()") < source.index("self._zero_grad_fn()") < source.index("self._backward_fn(")


def test_the_package_overrides_the_public_names_and_the_adapter_the_private_ones():
    assert DDPBase._register_ddp_hooks is not DDPStrategy._register_ddp_hooks
    assert RingDDPStrategy.register_comm_hooks is not DDPBase.register_comm_hooks
    assert RingDDPStrategy.configure_launcher is not DDPBase.configure_launcher
    assert ProfilerBase._create_profiler is not PyTorchProfiler._create_profiler
    assert AllThreadsProfiler.make_profiler is not ProfilerBase.make_profiler
    assert "_register_ddp_hooks" not in vars(RingDDPStrategy) and "_create_profiler" not in vars(AllThreadsProfiler)


# Classes whose ``self`` carries Lightning's attributes (a ``self._trainer`` elsewhere is the class's own)
LIGHTNING_BASES = {"DDPStrategy", "DDPBase", "PyTorchProfiler", "ProfilerBase", "LightningModule", "Trainer"}


def _reaches(tree: ast.AST, names: set[str]):
    """``(line, name)`` of every reached private name in ``tree``: an import of it, an attribute of another object, or
    a method or ``self`` attribute of that name in a subclass of a Lightning class."""
    lightning_self = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        if any(ast.unparse(base).rsplit(".", 1)[-1] in LIGHTNING_BASES for base in cls.bases):
            lightning_self |= {id(n) for n in ast.walk(cls)}
    for node in ast.walk(tree):
        if isinstance(node, ast.alias) and node.name.rsplit(".", 1)[-1] in names:
            yield node.lineno, node.name
        elif isinstance(node, ast.FunctionDef) and node.name in names and id(node) in lightning_self:
            yield node.lineno, node.name
        elif isinstance(node, ast.Attribute) and node.attr in names:
            on_self = isinstance(node.value, ast.Name) and node.value.id == "self"
            if not on_self or id(node) in lightning_self:
                yield node.lineno, node.attr


def test_no_module_but_the_adapter_names_a_private_name_it_reaches():
    names = {name for _, name in REACHED}
    found = [f"{path.relative_to(PACKAGE)}:{line}: {name}" for path in sorted(PACKAGE.rglob("*.py"))
             if path != PACKAGE / "upstream.py" for line, name in _reaches(ast.parse(path.read_text()), names)]
    assert not found, "reach these through lightning_dist.upstream:\n" + "\n".join(found)


@pytest.mark.parametrize("source, expected", [
    ("trainer._checkpoint_connector.dump_checkpoint()", ["_checkpoint_connector"]),
    ("module._trainer is None", ["_trainer"]),
    ("self._trainer = trainer", []),  # a class's own attribute
    ("class D:\n    @property\n    def _trainer(self): ...", []),
    ("class S(DDPBase):\n    def f(self):\n        return self._timeout", ["_timeout"]),
    ("class S(DDPStrategy):\n    def _register_ddp_hooks(self): ...", ["_register_ddp_hooks"]),
    ("from lightning.fabric.utilities.distributed import _init_dist_connection", ["_init_dist_connection"]),
])
def test_the_scan_finds_what_it_names(source, expected):
    assert [name for _, name in _reaches(ast.parse(source), {name for _, name in REACHED})] == expected
