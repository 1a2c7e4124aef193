"""unison/config/__init__.py: dump_config writes what load_config reads back, strings included."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from unison.config import dump_config, load_config

BASE = "model: {type: !pyobject torch.nn.Linear}\ndata: {build: !pyobject mine.build}\n"


def test_strings_that_read_as_numbers_under_yaml_1_2_stay_strings(tmp_path: Path):
    path = tmp_path / "config.yaml"
    path.write_text(BASE + "training:\n  optimizer_kwargs: {tag: '1e3', flag: 'yes', n: '12', lr: 3e-4}\n")
    config = load_config(path)
    again = tmp_path / "again.yaml"
    again.write_text(dump_config(config))
    assert load_config(again).training.optimizer_kwargs == {
        "tag": "1e3",
        "flag": "yes",
        "n": "12",
        "lr": 3e-4,
    }


@settings(max_examples=25, deadline=None)
@given(
    values=st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=12) | st.floats(allow_nan=False))
)
def test_any_kwargs_round_trip(tmp_path_factory, values):
    folder = tmp_path_factory.mktemp("dump")
    path = folder / "config.yaml"
    path.write_text(BASE)
    config = load_config(path)
    config.model.kwargs = values
    again = folder / "again.yaml"
    again.write_text(dump_config(config))
    assert load_config(again) == config


def test_a_long_string_stays_on_one_line_so_a_password_in_it_is_masked_whole(tmp_path: Path):
    from unison.utils.secrets import redact_url

    password = "pass word " * 8  # spaces: YAML would fold the string across lines at 80 columns
    uri = f"postgresql://someone:{password}@db.example.org/runs"
    path = tmp_path / "config.yaml"
    path.write_text(BASE + f"logging:\n  mlflow: {{tracking_uri: '{uri}'}}\n")
    text = dump_config(load_config(path))
    assert uri in text  # one line
    assert "pass word" not in redact_url(text) and "db.example.org/runs" in redact_url(text)
