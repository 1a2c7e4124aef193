"""A config's path stays inside its root however a URL's reader decodes it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from unison.utils.confine import ConfinementError, confined_path, decoded


@pytest.mark.parametrize(
    "text",
    [
        "%2F..%2F..%2Fx.db",  # SQLAlchemy reads /../../x.db
        "%2f..%2f..%2fx.db",
        "..%2Fx.db",
        "%2E%2E/x.db",
        "a/%2e%2e/%2e%2e/x.db",
        "%252F..%252F..%252Fx.db",  # encoded twice
        "%25252E%25252E/x.db",  # three times
        "..%5Cx.db",
        "x.db%00.txt",
        "../x.db",
        "a/../../x.db",
        "/etc/x.db",
        "x.db?mode=rwc",
        "x.db#frag",
    ],
)
def test_a_path_that_may_be_read_outside_the_root_is_refused(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfinementError, match="x.db"):
        confined_path(text, tmp_path / "root")


def test_a_link_out_of_the_root_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(tmp_path, root / "out")
    with pytest.raises(ConfinementError, match="outside"):
        confined_path("out/x.db", root)


@pytest.mark.parametrize(
    ("text", "inside"),
    [("mlflow.db", "mlflow.db"), ("team/mlflow.db", "team/mlflow.db"), ("a/../b.db", "b.db"), ("r%41.db", "r%41.db")],
)
def test_a_path_inside_the_root_is_kept(tmp_path: Path, text: str, inside: str) -> None:
    assert confined_path(text, tmp_path) == tmp_path.resolve() / inside


def test_decoding_stops_at_a_nest_built_to_outlast_it() -> None:
    text = "x"
    for _ in range(20):
        text = text.replace("%", "%25") if "%" in text else "%78"
    with pytest.raises(ConfinementError, match="still percent-encoded"):
        decoded(text)
