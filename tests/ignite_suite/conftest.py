"""The ignite suite's place in ours: its metric run left out unless asked for. (The count of
ignite's tests that passed is printed by tests/conftest.py, which the controller of a run
split over pytest-xdist workers loads too.)"""

from __future__ import annotations

import pytest
from run_ignite_suite import METRICS_MARK

# The plugins of the child pytest are not for this one (--doctest-modules would import them).
collect_ignore = ["unison_ignite_plugin.py", "ignite_run_plugin.py"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{METRICS_MARK}: ignite's distributed metric tests with unison's Engine (minutes); run with -m {METRICS_MARK}",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselects the ``ignite_metrics`` tests unless the mark expression names them."""
    if METRICS_MARK in (config.getoption("markexpr", "") or ""):
        return
    left_out = [item for item in items if item.get_closest_marker(METRICS_MARK)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if not item.get_closest_marker(METRICS_MARK)]
