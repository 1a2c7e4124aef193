"""Hypothesis profiles for the differential tests: ``ci`` (the default) and ``thorough``.

Shapes are drawn in the test process and run in batches on spawned ranks (see
``_shapes.draw_shapes``); ``max_examples`` is how many shapes each test draws per world size.
Select a profile with ``HYPOTHESIS_PROFILE=thorough``.
"""

from __future__ import annotations

import os

try:
    from hypothesis import settings
except ImportError:  # hypothesis is in the [test] extra; a venv made without it skips this folder
    collect_ignore_glob = ["test_diff_*.py", "_*.py"]
else:
    settings.register_profile("ci", max_examples=45, derandomize=True, deadline=None, database=None)
    settings.register_profile("thorough", max_examples=300, derandomize=True, deadline=None, database=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
