"""Two "nodes" on one machine: two torchrun agents, 2 ranks each, meeting through c10d on loopback.

This is the layout of ``slurm/multi-node-multi-gpu.sbatch`` without SLURM: global ranks 2
and 3 run on the second agent with LOCAL_RANK 0 and 1, so every place where RANK and
LOCAL_RANK differ is exercised: the checkpoint is written by global rank 0 only, logs come
from global rank 0 only, and a second 2x2 run with ``--resume auto`` continues the first.

Each agent runs in a session of its own; torchrun puts its ranks in sessions of their own
too, so on a timeout the test kills each agent's process group and then every process
below the agents (listed from /proc before they die), and nothing else.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _procs import kill_tree

from unison.checkpoint.lock import LOCK_FILE
from unison.distributed import find_free_port

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CONFIG = ROOT / "recipes" / "digits" / "config.yaml"
NNODES, NPROC = 2, 2
WORLD = NNODES * NPROC
EVERY_ITERS = 3
RUN_TIMEOUT_S = 150  # one 2x2 run: ~35 s on an idle 2-core machine, 4 ranks + 2 agents
SAVE_LINE = re.compile(r"Saved (sharded )?checkpoint (?P<path>\S+\.(pt|dcp))$")


def end_agents(procs: list[subprocess.Popen]) -> None:
    """Kills what the test started: each agent's process group and the ranks below it."""
    kill_tree(*procs)


def run_two_nodes(root: Path, tag: str, *extra: str) -> list[str]:
    """Runs the digits recipe as 2 agents x 2 ranks; returns each agent's output (node 0, node 1)."""
    port = find_free_port()
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")])),
    )
    for key in list(env):
        if key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") or key.startswith(
            ("SLURM_", "TORCHELASTIC_")
        ):
            env.pop(key)
    procs, outputs = [], []
    for node in range(NNODES):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={NNODES}", f"--nproc_per_node={NPROC}",
            "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=unison-test-{tag}",
            "--monitor_interval=1",
            "-m", "unison.cli", "run", str(CONFIG),
            "--set", f"checkpoint.every_iters={EVERY_ITERS}",
            "--set", "logging.progress=false",
            "--set", "logging.tensorboard=false",
            "--set", f"logging.root={root}",
            "--set", "imports=[multinode_probe]",
            "--set", "hooks.after_training=!pyobject multinode_probe.record",
            *extra,
        ]  # fmt: skip
        out = root / f"agent-{tag}-{node}.out"
        outputs.append(out)
        with open(out, "w") as fh:
            procs.append(
                subprocess.Popen(
                    cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        end_agents(procs)
        shown = "\n".join(f"--- agent {i} ---\n{p.read_text()[-3000:]}" for i, p in enumerate(outputs))
        pytest.fail(f"the 2x2 torchrun run ({tag}) did not finish in {RUN_TIMEOUT_S} s:\n{shown}")
    texts = [p.read_text() for p in outputs]
    for node, (proc, text) in enumerate(zip(procs, texts, strict=True)):
        assert proc.returncode == 0, f"agent {node} ({tag}) exited with {proc.returncode}:\n{text[-4000:]}"
    return texts


def run_dir_of(root: Path) -> Path:
    runs = sorted((root / "digits").iterdir())
    assert len(runs) == 1, f"expected one run directory, got {runs}"
    return runs[0]


def saved_iterations(output: str) -> list[int]:
    """The iterations of the "Saved checkpoint" lines, in order, duplicates kept."""
    paths = [m["path"] for m in map(SAVE_LINE.search, output.splitlines()) if m]
    return [int(Path(p).stem.rsplit("-i", 1)[1]) for p in paths]


def check_folder(folder: Path) -> list[dict]:
    """The manifest's entries, after checking it agrees with the folder: one file per entry."""
    entries = json.loads((folder / "manifest.json").read_text())["checkpoints"]
    iterations = [e["iteration"] for e in entries]
    assert iterations == sorted(set(iterations)), f"manifest entries out of order or repeated: {entries}"
    on_disk = sorted(p.name for p in folder.iterdir() if p.name not in ("manifest.json", LOCK_FILE))
    assert on_disk == sorted(e["file"] for e in entries), (
        f"the folder ({on_disk}) and the manifest ({entries}) disagree: a leftover, a temp file or a duplicate"
    )
    for e in entries:
        path = folder / e["file"]
        size = sum(f.stat().st_size for f in path.iterdir()) if path.is_dir() else path.stat().st_size
        assert size == e["size"], e
    return entries


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_agents_checkpoint_log_and_resume_once(tmp_path, strategy):
    # -- a first run: one epoch, a checkpoint every 3 iterations and at the epoch's end ------
    first = run_two_nodes(
        tmp_path, f"first-{strategy}", "--set", "training.max_epochs=1", "--set", f"parallel.strategy={strategy}"
    )
    run_dir = run_dir_of(tmp_path)
    both = "\n".join(first)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["world_size"] == WORLD and metrics["epochs"] == 1
    length = metrics["iterations"]  # one pass over a quarter of the training set
    assert length > EVERY_ITERS

    # Placement: ranks 2 and 3 ran on the second agent, where LOCAL_RANK differs from RANK.
    placement = {}
    for r in range(WORLD):
        path = run_dir / "placement" / f"rank{r}.json"
        assert path.exists(), f"rank {r} did not run its after_training hook"
        placement[r] = json.loads(path.read_text())
    for r, p in placement.items():
        assert p["launcher"] == "torchrun", p
        assert p["rank"] == r == int(p["env"]["RANK"]), p
        assert p["world_size"] == WORLD == int(p["env"]["WORLD_SIZE"]), p
        assert p["nnodes"] == NNODES, p
        assert p["local_rank"] == int(p["env"]["LOCAL_RANK"]) == r % NPROC, p
        assert p["node_rank"] == int(p["env"]["GROUP_RANK"]) == r // NPROC, p
        assert p["iterations"] == length, p
    assert [r for r, p in placement.items() if p["local_rank"] != p["rank"]] == [2, 3]
    agents = [{placement[r]["ppid"] for r in range(WORLD) if r // NPROC == node} for node in range(NNODES)]
    assert all(len(a) == 1 for a in agents) and agents[0] != agents[1], (
        f"each node's ranks should share one torchrun agent, and the two nodes differ: {agents}"
    )

    # Logs: from global rank 0 only; rank 2 is LOCAL_RANK 0 too, and must stay quiet.
    epoch_lines = re.findall(r"^.*epoch 1/1  train loss .*$", both, flags=re.M)
    assert len(epoch_lines) == 1, f"the epoch line should appear once across both agents:\n{both}"
    assert epoch_lines[0].startswith(f"[rank 0/{WORLD}]"), epoch_lines
    logs = run_dir / "logs"
    assert sorted(p.name for p in logs.glob("rank*.log")) == [f"rank{r}.log" for r in range(WORLD)]
    assert "epoch 1/1  train loss" in (logs / "rank0.log").read_text()
    for r in range(1, WORLD):
        text = (logs / f"rank{r}.log").read_text()
        assert "epoch 1/1" not in text and "Saved checkpoint" not in text, f"rank {r} logged:\n{text}"

    # Checkpoints: each written once, by one rank, into one consistent manifest.
    expected = sorted({*range(EVERY_ITERS, length + 1, EVERY_ITERS), length})
    assert saved_iterations(both) == expected, f"checkpoint saves, duplicates kept:\n{both}"
    folder = run_dir / "checkpoints"
    entries = check_folder(folder)
    assert entries[-1]["iteration"] == length
    newest = folder / entries[-1]["file"]
    if strategy == "fsdp":  # a folder: every rank's shards, and the rest written by rank 0
        assert sorted(p.name for p in newest.glob("__*_*.distcp")) == [f"__{r}_0.distcp" for r in range(WORLD)]
        newest = newest / "rest.pt"
    last = torch.load(newest, map_location="cpu", weights_only=True)
    assert last["meta"]["world_size"] == WORLD and last["meta"]["iteration"] == length
    assert len(last["rng"]) == WORLD, "the checkpoint should hold every rank's generator states"
    if strategy == "fsdp":
        return  # resuming sharded checkpoints, at any world size: tests/distributed/test_sharded_checkpoint.py

    # -- a second 2x2 run resumes it and trains one more epoch ------------------------------
    second = run_two_nodes(tmp_path, "resume", "--set", "training.max_epochs=2", "--resume", "auto")
    assert run_dir_of(tmp_path) == run_dir, "resume=auto should continue in the same run directory"
    both = "\n".join(second)
    resumed = re.findall(rf"Resumed from (\S+) \(epoch 1, iteration {length}\)", both)
    assert resumed == [str(folder / entries[-1]["file"])], f"expected one 'Resumed from' line:\n{both}"
    assert len(re.findall(r"epoch 2/2  train loss", both)) == 1, both
    assert "epoch 1/2" not in both, f"the resumed run trained the first epoch again:\n{both}"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["world_size"] == WORLD
    assert metrics["iterations"] == 2 * length and metrics["epochs"] == 2, metrics
    expected = sorted(
        {*range(length + EVERY_ITERS - length % EVERY_ITERS, 2 * length + 1, EVERY_ITERS), 2 * length}
    )
    assert saved_iterations(both) == expected, both
    assert check_folder(folder)[-1]["iteration"] == 2 * length
    for r in range(WORLD):
        assert json.loads((run_dir / "placement" / f"rank{r}.json").read_text())["iterations"] == 2 * length
