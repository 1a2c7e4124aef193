"""``parallel.fault_tolerance`` read into the replica group's settings, and refused by ``unison run``."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torchft")  # the section is checked for torchft when loaded

from unison.config import ConfigError, load_config  # noqa: E402
from unison.distributed.replica_group import ReplicaSettings  # noqa: E402
from unison.recipe.planning.replica_plan import replica_settings  # noqa: E402
from unison.recipe.planning.run_plan import plan  # noqa: E402

BASE = """\
name: ft
model:
  type: !pyobject torch.nn.Linear
  kwargs: {in_features: 4, out_features: 2}
data:
  build: !pyobject torch.utils.data.TensorDataset
"""


def _config(tmp_path: Path, section: str):
    path = tmp_path / "c.yaml"
    path.write_text(BASE + section)
    return load_config(path), path


def test_the_section_gives_the_groups_settings(tmp_path: Path) -> None:
    config, _ = _config(
        tmp_path,
        "parallel:\n  fault_tolerance:\n    lighthouse: http://lh:29510\n    replica_id: 2\n"
        "    replica_groups: 3\n    min_replicas: 2\n    timeout: 5\n    quorum_timeout: 7\n"
        "    connect_timeout: 3\n    step_attempts: 4\n",
    )
    assert replica_settings(config) == ReplicaSettings(
        lighthouse="http://lh:29510",
        replica_id=2,
        replica_groups=3,
        min_replicas=2,
        timeout_s=5.0,
        quorum_timeout_s=7.0,
        connect_timeout_s=3.0,
        step_attempts=4,
    )


def test_without_the_section_there_is_no_group(tmp_path: Path) -> None:
    config, _ = _config(tmp_path, "")
    assert replica_settings(config) is None


def test_unison_run_refuses_the_section_at_its_line(tmp_path: Path) -> None:
    config, path = _config(tmp_path, "parallel:\n  fault_tolerance:\n    lighthouse: http://lh:29510\n")
    with pytest.raises(
        ConfigError, match=rf"{path}:8: parallel.fault_tolerance: .*replica_settings\(config\)"
    ):
        plan(config)
