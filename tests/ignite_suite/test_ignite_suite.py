"""ignite's own tests define a drop-in Engine: they run here against unison's Engine.

Each test runs a selection of ignite 0.5.5's test suite (fetched and cached by
``ignite_sdist.py``) in a pytest of its own with ``unison_ignite_plugin`` loaded, and fails
on any test that does not pass, but those in ``not_applicable.py`` (and on any entry there
that passes now). The count of ignite's tests that passed goes to the summary
(``conftest.py``) and to ``record_property``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from run_ignite_suite import METRICS_MARK, SELECTIONS, SUMMARY_KEY, SuiteRun, report, run_suite

SELECTION_MARGIN_S = 60  # pytest-timeout's limit exceeds the run's own: the run ends its child first


def _check(run: SuiteRun, record_property: Callable[[str, Any], None]) -> None:
    record_property(SUMMARY_KEY, run.summary_line())
    for name, count in run.counts().items():
        record_property(f"ignite_{run.selection.name}_{name}", count)
    if run.problems:
        pytest.fail(report(run), pytrace=False)


@pytest.mark.slow  # 444 of ignite's tests in a pytest of their own: about 30 s
@pytest.mark.timeout(SELECTIONS["engine"].timeout_s + SELECTION_MARGIN_S)
def test_ignite_engine_and_handler_tests_pass_with_unisons_engine(
    record_property: Callable[[str, Any], None],
) -> None:
    _check(run_suite(SELECTIONS["engine"]), record_property)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(SELECTIONS["distributed"].timeout_s + SELECTION_MARGIN_S)
def test_ignite_distributed_engine_and_handler_tests_pass_on_two_ranks(
    record_property: Callable[[str, Any], None],
) -> None:
    _check(run_suite(SELECTIONS["distributed"]), record_property)


@pytest.mark.distributed
@getattr(pytest.mark, METRICS_MARK)
@pytest.mark.timeout(SELECTIONS["metrics"].timeout_s + SELECTION_MARGIN_S)
def test_ignite_distributed_metric_tests_pass_on_two_ranks(
    record_property: Callable[[str, Any], None],
) -> None:
    _check(run_suite(SELECTIONS["metrics"]), record_property)
