"""unison/recipe/build/before_spawn.py: what fails before spawning, not in a rank.

Seen on a machine with one GPU: ``unison run --nproc 2`` failed in rank 1 as its process group
formed, with CUDA's "invalid device ordinal" (ignite sets ``cuda:LOCAL_RANK`` on gloo too). The count of ranks is checked
against the GPUs before any rank starts; here on the CPU, with the machine's GPU count and the
backend it would choose stood in for.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _tiny_run import DATA_MODULE

from unison.config import ConfigError, load_config
from unison.recipe import plan
from unison.recipe.build import before_spawn

CONFIG = """\
name: gpus
model:
  type: !pyobject torch.nn.Linear
  kwargs: {{in_features: 4, out_features: 2}}
data:
  build: !pyobject gpus_data.build
training:
  max_epochs: 1
  path: {root}
parallel:
  nproc_per_node: 2
"""


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")




def _planned(tmp_path: Path, extra: str = ""):
    (tmp_path / "gpus_data.py").write_text(DATA_MODULE)
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.format(root=tmp_path / "runs") + extra)
    return plan(load_config(path)), path


def test_more_ranks_than_gpus_are_refused_before_spawning(tmp_path: Path, one_gpu: None) -> None:
    planned, path = _planned(tmp_path)
    with pytest.raises(ConfigError) as err:
        before_spawn.check_gpus(planned, 2)
    text = str(err.value)
    assert text.startswith(f"{path}:") and "parallel.nproc_per_node" in text, text
    assert "2 ranks" in text and "shows 1 (CUDA_VISIBLE_DEVICES='0')" in text, text
    assert "--nproc 1" in text and "CUDA_VISIBLE_DEVICES= unison run" in text, text
    before_spawn.check_gpus(planned, 1)  # one rank per GPU is fine


def test_on_gloo_too_since_ignite_gives_each_rank_its_gpu(tmp_path: Path, one_gpu: None) -> None:
    planned, _ = _planned(tmp_path, "  backend: gloo\n")
    with pytest.raises(ConfigError, match="take a GPU each"):
        before_spawn.check_gpus(planned, 2)


def test_a_machine_without_gpus_takes_any_number_of_ranks(tmp_path: Path) -> None:
    planned, _ = _planned(tmp_path)
    if torch.cuda.is_available():
        pytest.skip("a machine with GPUs")
    before_spawn.check_gpus(planned, 8)
