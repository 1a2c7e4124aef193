"""Replica groups on torchft: what a killed group costs the others, and what the quorum costs per step.

Two replica groups of one process each (tests/fault_tolerance/_replica_worker.py: a unison
trainer made with ``create_replica_trainer``, Adam, batches of 4) on a real lighthouse in
this process (heartbeat timeout 2 s, join timeout 1 s).

    kill      once both groups share the quorum, group 1 is SIGKILLed; measured: the time
              from the kill to group 0's next committed step, the step numbers group 0
              skipped (steps lost), its tries that were not committed (each one a batch
              redone), and whether group 0 is still the same process
    rejoin    group 1 started again with other initial weights: the time from its start to
              its first committed step (healed from group 0, over HTTP), the part of it after
              the process had imported torch and unison and built its model (joining the
              quorum, healing, the step), and the longest gap between group 0's commits
              while it joined
    per step  the median time between committed steps of two groups (--steps steps each,
              no pacing), against a plain DDP loop on gloo with 2 ranks, the same model,
              optimizer and batches: the quorum's round trip to the lighthouse, the commit
              vote and the manager's bookkeeping, at two widths of the hidden layer

    python benchmarks/fault_tolerance.py             # ~2 min on 2 busy CPU cores
    python benchmarks/fault_tolerance.py --quick     # one kill, short timing runs
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT), str(ROOT / "tests" / "fault_tolerance")]

import _common as C  # noqa: E402
from replica_procs import lines as _lines  # noqa: E402
from replica_procs import start as _start  # noqa: E402
from replica_procs import steps as _steps  # noqa: E402


def _wait(condition: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.02)
    raise SystemExit(f"{what}: not seen in {timeout:g} s")


def _stop(out: Path, procs: list[subprocess.Popen]) -> None:
    (out / "stop").touch()
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def kill_and_rejoin(out: Path, pace: float) -> dict[str, Any]:
    from unison.distributed.replica_group import Lighthouse

    with Lighthouse(min_replicas=1) as lighthouse:
        procs = [_start(lighthouse.address, i, out, "--pace", str(pace)) for i in (0, 1)]
        try:

            def shared() -> bool:
                zero = {x["step"]: x["weights"] for x in _steps(out, 0)}
                return sum(zero.get(x["step"]) == x["weights"] for x in _steps(out, 1, procs[1].pid)) >= 6

            _wait(shared, 120, "both groups in one quorum")
            os.kill(procs[1].pid, signal.SIGKILL)
            killed = time.time()
            procs[1].wait()
            after = _wait(
                lambda: [x for x in _steps(out, 0) if x["time"] > killed], 60, "group 0's next commit"
            )
            _wait(lambda: len([x for x in _steps(out, 0) if x["time"] > killed]) >= 10, 60, "group 0 alone")
            started = time.time()
            procs[1] = _start(lighthouse.address, 1, out, "--seed", "5", "--pace", str(pace))
            first = _wait(lambda: _steps(out, 1, procs[1].pid), 120, "group 1 rejoining")[0]
            _wait(lambda: len(_steps(out, 1, procs[1].pid)) >= 5, 60, "group 1 training")
        finally:
            _stop(out, procs)
    ready = [x for x in _lines(out, 1) if "start" in x][-1]["time"]  # imports done, model built
    zero = _steps(out, 0)
    numbers = [
        x["step"] for x in zero
    ]  # from group 0's first commit (later than 1 if it healed at its start)
    ends = [x for x in _lines(out, 0) if "end" in x]
    around = [x["time"] for x in zero if started - 1 <= x["time"] <= first["time"] + 1]
    return {
        "kill_to_next_commit_s": after[0]["time"] - killed,
        "steps_lost": len(set(range(numbers[0], numbers[-1] + 1)) - set(numbers)),
        "tries_redone": ends[0]["failed_tries"] if ends else None,
        "survivor_restarted": len({x["pid"] for x in zero}) != 1,
        "rejoin_start_to_first_commit_s": first["time"] - started,
        "rejoin_ready_to_first_commit_s": first["time"] - ready,
        "rejoined_at_step": first["step"],
        "survivor_longest_gap_during_rejoin_s": max(
            (b - a for a, b in zip(around, around[1:], strict=False)), default=0.0
        ),
    }


def quorum_step_time(out: Path, steps: int, width: int) -> float:
    from unison.distributed.replica_group import Lighthouse

    with Lighthouse(min_replicas=2) as lighthouse:  # both groups in every quorum
        extra = ("--pace", "0", "--no-digests", "--width", str(width), "--steps", str(steps))
        procs = [_start(lighthouse.address, i, out, *extra) for i in (0, 1)]
        for proc in procs:
            proc.wait(timeout=600)
    times = [x["time"] for x in _steps(out, 0)][steps // 5 :]  # past the start and the first heal
    return statistics.median(b - a for a, b in zip(times, times[1:], strict=False))


def _ddp_rank(rank: int, port: int, steps: int, width: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1))
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(steps, 4, 4, generator=g)
    times = []
    for i in range(steps):
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x[i]), x[i].sum(1, keepdim=True).sin()).backward()
        optimizer.step()
        times.append(time.perf_counter())
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def ddp_step_time(out: Path, steps: int, width: int) -> float:
    import torch.multiprocessing as mp

    from unison.distributed import find_free_port

    path = out / f"ddp-{width}.json"
    mp.start_processes(
        _ddp_rank, args=(find_free_port(), steps, width, str(path)), nprocs=2, start_method="spawn"
    )
    times = json.loads(path.read_text())[steps // 5 :]
    return statistics.median(b - a for a, b in zip(times, times[1:], strict=False))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter timing runs")
    parser.add_argument(
        "--kills", type=int, default=None, help="kill and rejoin rounds (default 3; 1 with --quick)"
    )
    parser.add_argument(
        "--pace",
        type=float,
        default=0.0,
        help="seconds each step waits in the kill rounds (0: the kill lands mid-step)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the report here, as JSON")
    args = parser.parse_args(argv)
    kills = args.kills if args.kills is not None else (1 if args.quick else 3)
    steps = 100 if args.quick else 300

    env = C.environment()
    C.print_environment(env)
    rounds = []
    for i in range(kills):
        with tempfile.TemporaryDirectory() as tmp:
            rounds.append(kill_and_rejoin(Path(tmp), args.pace))
        print(f"kill round {i + 1}: {rounds[-1]}", flush=True)
    keys = list(rounds[0])
    C.print_table(
        "a replica group SIGKILLed, then started again (median of rounds; each round's in the JSON)",
        ["measure", "median", "rounds"],
        [[k, statistics.median(float(r[k] or 0) for r in rounds), [r[k] for r in rounds]] for k in keys],
    )
    per_step = []
    for width in (16, 1024):
        with tempfile.TemporaryDirectory() as tmp:
            quorum = quorum_step_time(Path(tmp), steps, width)
            ddp = ddp_step_time(Path(tmp), steps, width)
        per_step.append(
            {"width": width, "quorum_ms": quorum * 1e3, "ddp_ms": ddp * 1e3, "ratio": quorum / ddp}
        )
    C.print_table(
        f"per committed step, 2 groups of 1 rank against DDP at 2 ranks (median over {steps} steps)",
        ["hidden width", "quorum ms", "plain DDP ms", "quorum/DDP"],
        [[p["width"], f"{p['quorum_ms']:.2f}", f"{p['ddp_ms']:.2f}", f"{p['ratio']:.1f}x"] for p in per_step],
    )
    C.write_json(args.json, {"environment": env, "kill_rounds": rounds, "per_step": per_step})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
