"""pytest plugin: ignite's own tests run with unison's Engine in place of ignite's.

Loaded with ``-p unison_ignite_plugin`` (this folder on ``PYTHONPATH``), it acts before any
conftest or test module of ignite's is imported (``pytest_load_initial_conftests``), and makes ``unison.engine.Engine`` the ``Engine`` of:

- ``ignite.engine`` and ``ignite.engine.engine``, where ignite's tests import it from
  (``from ignite.engine import Engine``, ``from ignite.engine.engine import Engine``);
- ignite's modules whose code builds an ``Engine(...)`` when called (``BUILDERS``):
  ``create_supervised_trainer``/``create_supervised_evaluator``, the tbptt trainer, and the
  ``simulate_values`` of the parameter schedulers. So wherever ignite would build an Engine,
  the tests exercise unison's.

Not replaced, on purpose:

- ``DeterministicEngine`` (``ignite.engine.deterministic``): a subclass of ignite's own
  Engine with no counterpart in unison; ``create_supervised_trainer(deterministic=True)``
  and ``tests/ignite/engine/test_deterministic.py`` still test ignite's.
- ignite modules that only check ``isinstance(x, Engine)`` or annotate with it: unison's
  Engine is a subclass of ignite's, so those accept it, and they keep accepting a
  ``DeterministicEngine``.

All of ignite is imported before the swap, so no ignite module picks the swapped name up
by accident; :func:`pytest_configure` checks the result.
"""

from __future__ import annotations

import importlib
import sys

import ignite  # noqa: F401  # the whole package, before the swap (see the docstring)
import ignite.contrib.engines.tbptt
import ignite.engine
import ignite.engine.engine
import ignite.handlers.param_scheduler
import ignite.handlers.state_param_scheduler

from unison.engine import Engine as UnisonEngine

IGNITE_ENGINE = ignite.engine.engine.Engine

IMPORTED_FROM = ("ignite.engine", "ignite.engine.engine")
"""Where ignite's tests import ``Engine`` from."""

BUILDERS = (
    "ignite.contrib.engines.tbptt",  # create_supervised_tbptt_trainer
    "ignite.handlers.param_scheduler",  # ParamScheduler.simulate_values and the like
    "ignite.handlers.state_param_scheduler",  # StateParamScheduler.simulate_values
)
"""Modules of ignite's library whose functions build ``Engine(...)`` from their globals
(``ignite.engine``'s ``create_supervised_*`` are covered by ``IMPORTED_FROM``)."""

SWAPPED = IMPORTED_FROM + BUILDERS


def _swap() -> None:
    if not issubclass(UnisonEngine, IGNITE_ENGINE):
        raise RuntimeError("unison.engine.Engine is no longer a subclass of ignite's Engine")
    for name in SWAPPED:
        module = importlib.import_module(name)
        current = getattr(module, "Engine", None)
        if current is not IGNITE_ENGINE and current is not UnisonEngine:
            raise RuntimeError(
                f"{name}.Engine is {current!r}, not ignite's Engine: ignite changed; review BUILDERS"
            )
        module.Engine = UnisonEngine  # type: ignore[attr-defined]


_swapped = False


def pytest_load_initial_conftests() -> None:
    """The swap, before the first conftest of ignite's is imported. In a hook, not at import:
    a module that merely imports this one (pytest's ``--doctest-modules`` of our own suite)
    leaves ignite as it is."""
    global _swapped
    _swap()
    _swapped = True


def pytest_configure(config) -> None:  # type: ignore[no-untyped-def]
    """Fails the run at once if the swap did not happen, or did not hold."""
    if not _swapped:
        raise RuntimeError("load unison_ignite_plugin with -p: registered later, it swaps nothing")
    for name in SWAPPED:
        if sys.modules[name].Engine is not UnisonEngine:
            raise RuntimeError(f"{name}.Engine is not unison's Engine any more")


def pytest_report_header(config) -> list[str]:  # type: ignore[no-untyped-def]
    return [f"ignite's Engine replaced by {UnisonEngine.__module__}.Engine in: {', '.join(SWAPPED)}"]
