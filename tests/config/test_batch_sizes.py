"""unison/config/batch_sizes.py: a global batch size gives each rank's batch at any world size.

The truth for the sizes is arithmetic: samples per optimizer update across all ranks is the
per-rank batch x the world size x ``training.accumulation_steps``, whichever key gave it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from unison.config import Config, ConfigError, dump_config, load_config
from unison.config.batch_sizes import DEFAULT_BATCH_SIZE, batch_sizes

HEAD = "model:\n  type: !pyobject torch.nn.Linear\ndata:\n  build: !pyobject torch.utils.data.random_split\n"
"""Lines 1-4 of every config below: the training section starts at line 5."""


def _config(tmp_path: Path, body: str, overrides: list[str] | None = None) -> Config:
    path = tmp_path / "config.yaml"
    path.write_text(HEAD + body)
    return load_config(path, overrides)


@given(
    per_rank=st.integers(1, 8),
    world=st.integers(1, 6),
    accumulation=st.integers(1, 4),
    other_world=st.integers(1, 6),
)
def test_the_global_batch_is_the_same_at_every_world_size_it_divides(
    per_rank: int, world: int, accumulation: int, other_world: int
) -> None:
    c = Config()
    c.training.batch_size = None
    c.training.global_batch_size = per_rank * world * accumulation
    c.training.accumulation_steps = accumulation
    sizes = batch_sizes(c, world)
    assert sizes.training == per_rank
    assert sizes.validation == sizes.testing == sizes.predict == per_rank  # evaluation defaults to it
    assert sizes.training * world * accumulation == c.training.global_batch_size
    if c.training.global_batch_size % (other_world * accumulation) == 0:
        other = batch_sizes(c, other_world)
        assert other.training * other_world * accumulation == c.training.global_batch_size
    else:
        with pytest.raises(ConfigError, match="training.global_batch_size"):
            batch_sizes(c, other_world)


def test_a_size_that_does_not_divide_names_the_key_its_line_the_world_and_the_sizes_that_would(
    tmp_path: Path,
) -> None:
    c = _config(tmp_path, "training:\n  accumulation_steps: 1\n  global_batch_size: 30\n")
    with pytest.raises(ConfigError) as err:
        batch_sizes(c, 4)
    text = str(err.value)
    assert text.startswith(f"{tmp_path / 'config.yaml'}:7: training.global_batch_size: "), text
    assert "over 4 ranks" in text and "7.5 per rank" in text
    assert "a multiple of 4 (28 or 32)" in text
    assert "on 1, 2, 3, 5, 6, 10, 15 or 30 ranks" in text

    c = _config(tmp_path, "training:\n  accumulation_steps: 4\n  global_batch_size: 24\n")
    assert batch_sizes(c, 2).training == 3
    with pytest.raises(ConfigError) as err:
        batch_sizes(c, 4)
    text = str(err.value)
    assert "over 4 ranks x 4 accumulation steps" in text and "a multiple of 16 (16 or 32)" in text
    assert "on 1, 2, 3 or 6 ranks" in text

    c = _config(tmp_path, "training:\n  accumulation_steps: 4\n  global_batch_size: 30\n")
    with pytest.raises(ConfigError, match="no world size divides it: make it a multiple of 4"):
        batch_sizes(c, 1)


def test_evaluation_sections_take_a_global_size_of_their_own(tmp_path: Path) -> None:
    c = _config(
        tmp_path,
        "training:\n  batch_size: 5\nvalidation:\n  global_batch_size: 12\ntesting:\n  global_batch_size: 6\n",
    )
    assert (batch_sizes(c, 3).validation, batch_sizes(c, 3).testing, batch_sizes(c, 3).predict) == (4, 2, 4)
    assert batch_sizes(c, 3).training == 5
    with pytest.raises(ConfigError) as err:
        batch_sizes(c, 4)  # 12 divides, 6 does not
    assert ":10: testing.global_batch_size: " in str(err.value) and "over 4 ranks" in str(err.value)


def test_the_per_rank_batch_size_keeps_its_meaning(tmp_path: Path) -> None:
    c = _config(tmp_path, "training:\n  batch_size: 8\n  accumulation_steps: 3\n")
    assert {w: batch_sizes(c, w).training for w in (1, 2, 5)} == {1: 8, 2: 8, 5: 8}
    assert batch_sizes(Config(), 4).training == DEFAULT_BATCH_SIZE == 32  # neither key: 32 per rank


def test_batch_size_and_global_batch_size_are_one_or_the_other(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        _config(tmp_path, "training:\n  batch_size: 8\n  global_batch_size: 64\n")
    text = str(err.value)
    assert text.startswith(f"{tmp_path / 'config.yaml'}:7: training.global_batch_size: "), text
    assert "training.batch_size (line 6)" in text and "give one of them" in text
    with pytest.raises(ConfigError, match="validation.global_batch_size"):
        _config(tmp_path, "validation:\n  batch_size: 8\n  global_batch_size: 64\n")
    # The command line wins over the file, as it does for a key given under two names.
    c = _config(tmp_path, "training:\n  batch_size: 8\n", ["training.global_batch_size=64"])
    assert (c.training.batch_size, batch_sizes(c, 2).training) == (None, 32)
    c = _config(tmp_path, "training:\n  global_batch_size: 64\n", ["training.batch_size=4"])
    assert (c.training.global_batch_size, batch_sizes(c, 2).training) == (None, 4)
    c = Config()  # in Python both may be set, and neither wins
    c.training.global_batch_size = 64
    c.training.batch_size = 8
    with pytest.raises(ConfigError, match="training.global_batch_size: .*training.batch_size"):
        batch_sizes(c, 1)


def test_a_global_size_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r":6: training.global_batch_size: must be > 0, got 0"):
        _config(tmp_path, "training:\n  global_batch_size: 0\n")


def test_lr_scaling_by_the_world_size_is_refused_with_a_global_batch(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        _config(tmp_path, "training:\n  global_batch_size: 64\n  lr_scaling: linear\n")
    text = str(err.value)
    assert ":7: training.lr_scaling: " in text and "reference_batch_size" in text
    c = _config(  # the mapping form names the batch the learning rate was tuned for
        tmp_path,
        "training:\n  global_batch_size: 64\n  lr_scaling: {rule: linear, reference_batch_size: 32}\n",
    )
    assert batch_sizes(c, 2).training == 32


def test_a_dumped_config_with_a_global_batch_loads_back(tmp_path: Path) -> None:
    c = _config(tmp_path, "training:\n  global_batch_size: 64\nvalidation:\n  global_batch_size: 16\n")
    again = tmp_path / "again.yaml"
    again.write_text(dump_config(c))
    assert load_config(again) == c
    assert batch_sizes(load_config(again), 4) == batch_sizes(c, 4)


def test_predictions_take_a_global_size_too(tmp_path: Path) -> None:
    """``predict.global_batch_size`` divides over the ranks like the evaluation sections' sizes;
    without it predictions take validation's per-rank batch."""
    c = _config(tmp_path, "training:\n  batch_size: 5\npredict:\n  enabled: true\n  global_batch_size: 12\n")
    assert {w: batch_sizes(c, w).predict for w in (1, 2, 3)} == {1: 12, 2: 6, 3: 4}
    with pytest.raises(ConfigError) as err:
        batch_sizes(c, 5)
    text = str(err.value)
    assert ":9: predict.global_batch_size: 12 (samples per prediction step across all ranks)" in text, text
    assert "run on 1, 2, 3, 4, 6 or 12 ranks" in text, text
    with pytest.raises(ConfigError, match="predict.global_batch_size: set together with predict.batch_size"):
        _config(tmp_path, "predict:\n  batch_size: 4\n  global_batch_size: 12\n")
    assert batch_sizes(_config(tmp_path, "validation:\n  batch_size: 7\n"), 2).predict == 7
