"""URL credentials masked in every copy of a URL that leaves the process."""

from __future__ import annotations

import pytest

from unison.utils.secrets import MASK, redact, redact_url


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("postgresql://u:PASS@host/db", "postgresql://u:***@host/db"),
        ("postgresql+psycopg2://u:PASS@host:5432/db", "postgresql+psycopg2://u:***@host:5432/db"),
        ("redis://:PASS@cache:6379/0", "redis://:***@cache:6379/0"),
        ("mysql://u:P@SS/w:rd@host/db", "mysql://u:***@host/db"),  # "@" "/" ":" inside a password
        ("https://PASS@git.example.org/x.git", "https://***@git.example.org/x.git"),
        ("git+https://PASS@host/x", "git+https://***@host/x"),
        ("http://h/db?ssl=1&password=PASS", "http://h/db?ssl=1&password=***"),
        ("http://h/x?token=PASS#frag", "http://h/x?token=***#frag"),
        ("http://h/x?a=1;access_token=PASS", "http://h/x?a=1;access_token=***"),
        ("https://acct.blob/c?sv=1&sig=PASS", "https://acct.blob/c?sv=1&sig=***"),
        ("opening 'postgresql://u:PASS@h/db' failed", "opening 'postgresql://u:***@h/db' failed"),
        ("a postgresql://u:PASS@h/db and redis://:PASS@r/0", "a postgresql://u:***@h/db and redis://:***@r/0"),
    ],
)
def test_credentials_are_masked_and_the_rest_kept(text: str, expected: str) -> None:
    assert redact_url(text) == expected
    assert "PASS" not in redact_url(text)


@pytest.mark.parametrize(
    "text",
    [
        "postgresql://mlflow@db.example.org/runs",  # a user alone: kept for diagnosis
        "sqlite:////runs/mlflow.db",
        "http://localhost:5000",
        "databricks",
        "https://h/path/user@example.org",  # an "@" in the path is no user information
        "http://h/x?designation=a&monkey=b",
        "training.lr=0.1",
    ],
)
def test_text_without_credentials_is_unchanged(text: str) -> None:
    assert redact_url(text) == text


def test_redact_walks_nested_values_and_leaves_the_input_alone() -> None:
    config = {
        "tuning": {"storage": "postgresql://u:PASS@h/db", "trials": 4},
        "logging": {"mlflow": {"tracking_uri": "https://TOKEN@mlflow.example.org"}},
        "sets": ["x=1", "storage=mysql://:PASS@h/db"],
        "pair": ("postgresql://u:PASS@h/db", None),
    }
    out = redact(config)
    assert "PASS" not in repr(out) and "TOKEN" not in repr(out)
    assert out["tuning"] == {"storage": f"postgresql://u:{MASK}@h/db", "trials": 4}
    assert out["pair"] == (f"postgresql://u:{MASK}@h/db", None)
    assert config["tuning"]["storage"] == "postgresql://u:PASS@h/db"  # the running code keeps the URL
