"""``parallel.fault_tolerance`` read into the replica group's settings, which the run's plan carries."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torchft")  # the section is checked for torchft when loaded

from unison.config import load_config  # noqa: E402
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


def test_the_plan_carries_the_groups_settings_and_its_own_run_folder(tmp_path: Path) -> None:
    (tmp_path / "ftdata.py").write_text(
        "import torch\n\ndef build(seed):\n    d = torch.utils.data.TensorDataset(torch.zeros(4, 4))\n    return d, d\n"
    )
    base = BASE.replace("torch.utils.data.TensorDataset", "ftdata.build")
    section = "parallel:\n  fault_tolerance:\n    lighthouse: http://lh:29510\n    replica_id: 1\n"
    (tmp_path / "c.yaml").write_text(base + section)
    config = load_config(tmp_path / "c.yaml")
    planned = plan(config)
    assert planned.replica == replica_settings(config)
    assert planned.run_root == planned.root / "ft-replica1"  # two groups on one machine share no folder
    (tmp_path / "c.yaml").write_text(base)
    alone = plan(load_config(tmp_path / "c.yaml"))
    assert alone.replica is None and alone.run_root == alone.root / "ft"
