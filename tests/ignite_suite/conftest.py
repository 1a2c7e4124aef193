"""The ignite suite's place in ours: its metric run left out unless asked for, and the count
of ignite's tests that passed printed in the summary."""

from __future__ import annotations

from typing import Any

import pytest
from run_ignite_suite import METRICS_MARK, SUMMARY_KEY

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


def pytest_terminal_summary(terminalreporter: Any) -> None:
    lines = [
        value
        for outcome in ("passed", "failed")
        for report in terminalreporter.stats.get(outcome, [])
        if getattr(report, "when", "call") == "call"
        for key, value in getattr(report, "user_properties", [])
        if key == SUMMARY_KEY
    ]
    if lines:
        terminalreporter.section("ignite's own tests")
        for line in lines:
            terminalreporter.line(line)
