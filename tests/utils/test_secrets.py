"""URL credentials masked in every copy of a URL that leaves the process."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
        (
            "a postgresql://u:PASS@h/db\nand redis://:PASS@r/0",
            "a postgresql://u:***@h/db\nand redis://:***@r/0",
        ),
        # on one line a password may hold " redis://:" as well: masked up to the line's last "@"
        ("a postgresql://u:PASS@h/db and redis://:PASS@r/0", "a postgresql://u:***@r/0"),
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


# -- passwords of any printable characters, libpq keyword strings, fragments -----------------------

PRINTABLE = st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=30)
HOSTS = st.from_regex(r"[a-z][a-z0-9\-]{0,10}(\.[a-z][a-z0-9\-]{0,8}){0,2}(:[0-9]{2,5})?", fullmatch=True)
TAILS = st.sampled_from(["", "/", "/db", "/runs?ssl=true", "/x#part"])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("postgresql://u:it's@host/db", "postgresql://u:***@host/db"),  # "'" is allowed as written
        ('mysql://u:a"b<c>d@host/db', "mysql://u:***@host/db"),
        ("postgresql://u:a b@host/db", "postgresql://u:***@host/db"),  # a space, in a YAML or log line
        ("tracking_uri: 'postgresql://u:it''s@host/db'", "tracking_uri: 'postgresql://u:***@host/db'"),
        ("postgresql://o'brien:pw@host/db", "postgresql://o'brien:***@host/db"),
        ("host=x password='a b' dbname=y", "host=x password=*** dbname=y"),
        ("host=x password = 'it\\'s' dbname=y", "host=x password = *** dbname=y"),
        ("host=x password=s3cret dbname=y", "host=x password=*** dbname=y"),
        ("dbname=y sslpassword=s3cret", "dbname=y sslpassword=***"),
        (
            "https://app.example.org/cb#access_token=PASS&type=bearer",
            "https://app.example.org/cb#access_token=***&type=bearer",
        ),
        ("https://h/x#token=PASS", "https://h/x#token=***"),
        ("http://h/x?token=it'sPASS&a=1", "http://h/x?token=***&a=1"),
    ],
)
def test_passwords_with_quotes_spaces_and_keyword_strings_are_masked(text: str, expected: str) -> None:
    assert redact_url(text) == expected
    assert redact_url(expected) == expected  # masking twice changes nothing


@settings(max_examples=300, deadline=None)
@given(
    scheme=st.sampled_from(["postgresql", "mysql+pymysql", "redis", "https", "http", "mongodb"]),
    user=st.from_regex(r"[A-Za-z0-9._\-]{0,8}", fullmatch=True),
    password=PRINTABLE,
    host=HOSTS,
    tail=TAILS,
    around=st.sampled_from(["{}", "tracking_uri: {}", "opening '{}' failed", 'uri="{}"']),
)
def test_a_password_of_any_printable_characters_never_appears_and_the_host_stays(
    scheme: str, user: str, password: str, host: str, tail: str, around: str
) -> None:
    url = f"{scheme}://{user}:{password}@{host}{tail}"
    masked = redact_url(around.format(url))
    assert masked == around.format(f"{scheme}://{user}:{MASK}@{host}{tail}")


@settings(max_examples=200, deadline=None)
@given(password=PRINTABLE)
def test_a_keyword_string_password_never_appears(password: str) -> None:
    quoted = "'" + password.replace("\\", "\\\\").replace("'", "\\'") + "'"
    text = f"host=db.example.org password={quoted} dbname=runs"
    assert redact_url(text) == f"host=db.example.org password={MASK} dbname=runs"


def test_a_config_error_masks_its_origin_and_its_problem_apart() -> None:
    from unison.config import ConfigError

    url = "postgresql://u:it's s3cret@db.example.org/runs"
    err = ConfigError(f"cannot open {url}: connection refused", file=f"--set tuning.storage={url}")
    masked = f"postgresql://u:{MASK}@db.example.org/runs"
    assert str(err) == f"--set tuning.storage={masked}: cannot open {masked}: connection refused"
