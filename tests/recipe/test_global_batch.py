"""A global batch size in a run: the plan divides it by the launch's world size.

The truth is a comparison: one process with the global batch is the truth for two ranks,
which must see the same samples in each optimizer update and train to the same weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _global_batch_workers import trained, write_config

import unison.recipe.phases as runner
from unison.config import ConfigError, load_config
from unison.recipe.planning.resolved import resolve
from unison.recipe.planning.run_plan import plan
from unison.testing import run_distributed

WEIGHTS_ATOL = 1e-6
"""Float32 sums in another order (two ranks' gradients averaged by DDP): equal to about 1e-7."""


def _updates(ranks: list[dict[str, Any]], accumulation: int) -> list[list[list[float]]]:
    """The samples of each optimizer update, over every rank, sorted (a sample is its input row)."""
    iterations = len(ranks[0]["batches"])
    assert all(len(r["batches"]) == iterations for r in ranks)
    updates = []
    for start in range(0, iterations, accumulation):
        rows = [row for r in ranks for batch in r["batches"][start : start + accumulation] for row in batch]
        updates.append(sorted(rows))
    return updates


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_and_two_ranks_with_the_same_global_batch_see_the_same_updates_and_weights(
    tmp_path: Path,
) -> None:
    cases = [  # (the batch key, accumulation steps, per-rank batch at 1 rank, at 2 ranks)
        ("global_batch_size: 4", 1, 4, 2),
        ("global_batch_size: 6", 3, 2, 1),
        (
            "batch_size: 3",
            1,
            3,
            3,
        ),  # per rank, as QuantumGrav's configs mean it: an update grows with the ranks
    ]
    paths = [str(write_config(tmp_path / f"case{i}", key, acc)) for i, (key, acc, _, _) in enumerate(cases)]
    paths.append(str(write_config(tmp_path / "told", "global_batch_size: 4", build="build_for")))
    one = trained(paths)  # one process: the truth
    two = run_distributed(trained, paths, nproc=2, timeout=240)
    for i, (key, accumulation, at_one, at_two) in enumerate(cases):
        assert one[i]["batch_size"] == at_one and [r[i]["batch_size"] for r in two] == [at_two, at_two], key
        if key.startswith("batch_size"):
            continue
        truth, ranks = _updates([one[i]], accumulation), _updates([r[i] for r in two], accumulation)
        assert ranks == truth, key  # the same samples in every optimizer update
        assert torch.equal(two[0][i]["weights"], two[1][i]["weights"])
        assert torch.allclose(two[0][i]["weights"], one[i]["weights"], rtol=0, atol=WEIGHTS_ATOL), key
    assert one[-1]["told"] == 1 and [r[-1]["told"] for r in two] == [2, 2]  # data.build(world_size=...)


def test_a_size_that_does_not_divide_fails_before_any_rank_is_spawned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_config(tmp_path, "global_batch_size: 6")
    spawned: list[Any] = []
    monkeypatch.setattr(runner, "launch", lambda *args, **kwargs: spawned.append(kwargs) or [{}])
    with pytest.raises(ConfigError, match=r"config.yaml:8: training.global_batch_size: 6 .* over 4 ranks"):
        runner.run(path, nproc=4)
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(key, value)  # one rank of four under torchrun: WORLD_SIZE is the world size
    with pytest.raises(ConfigError, match=r"training.global_batch_size: 6 .* over 4 ranks"):
        runner.run(path)
    assert not spawned and not (tmp_path / "runs").exists()
    monkeypatch.setenv("WORLD_SIZE", "3")  # 6 divides over 3: the run goes on to launch its ranks
    runner.run(path)
    assert spawned


def test_a_data_builder_asks_for_the_world_size_by_a_parameter_of_that_name(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, "batch_size: 2", build="build_for"))
    assert plan(config, world_size=3).loaders.training.batch_size == 2
    path = write_config(tmp_path / "given", "batch_size: 2", build="build_for")
    path.write_text(path.read_text().replace("build_for\n", "build_for\n  kwargs: {world_size: 2}\n"))
    with pytest.raises(ConfigError, match=r"data.kwargs.world_size: .*given by the run"):
        resolve(load_config(path))
