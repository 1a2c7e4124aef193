"""unison/cli/launch_checks.py: the launcher, rendezvous and network checks of ``unison doctor``.

Each check is exercised through the whole report in tests/cli/test_doctor.py; here are
the helpers worth testing on their own.
"""

from __future__ import annotations

import pytest

from unison.cli.launch_checks import _ifname_matches


@pytest.mark.parametrize(
    "spec, matches",
    [("eth", True), ("eth0,ib", True), ("=eth", False), ("=eth0", True), ("^docker,lo", True), ("ib", False)],
)
def test_interface_selectors(spec: str, matches: bool) -> None:
    assert _ifname_matches(spec, ["lo", "eth0"]) is matches
