"""Start-up: where a recipe run's time goes from the command to its first iteration.

Three commands, 2 ranks each, on the CPU (gloo), the digits recipe's data and model:

    spawned     python -m unison run recipes/digits/config.yaml --nproc 2
    torchrun    python -m torch.distributed.run --standalone --nproc_per_node=2 -m unison run <config>
    raw         python -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/startup_raw_ddp.py

The recipe runs are cut to 2 iterations of one epoch (``training.epoch_length=2``,
``max_epochs=1``) in a temporary ``logging.root``; the raw script (gloo, a DistributedSampler,
DDP, Adam on the same digits) stops after 2 iterations too. Every command runs with
``UNISON_STARTUP_TRACE=<file>`` (``unison.utils.startup``): each process appends a line per
phase it passes; the script writes ``launch`` just before starting the command. A phase's time
is the latest process to reach it (both ranks for the rank phases), less the previous phase's.

Phases: ``cli`` (the interpreter started and ``import unison``; under torchrun its agent
first), ``run`` (the recipe layer imported), ``config``, ``plan``, ``checks`` (preflight: the
model built on the meta device, the device, the output folder; the resume and port checks),
``process_group`` (spawned: the ranks started, imported and grouped; under torchrun the group
of ranks that each did all of the above), ``rank_plan`` (the rank plans the config again),
``run_folder``, ``data``, ``model``, ``build`` (optimizer, trainer, handlers),
``first_batch`` and ``first_iteration``. The raw script marks ``imports``,
``process_group``, ``data``, ``model``, ``first_batch``, ``first_iteration``.

Commands interleave, in an order rotated every round. Reported: each phase's median over
rounds, and launch to first iteration per command with its paired difference to raw
(median over rounds of unison's minus raw's of the same round). Target: under torchrun,
at most raw torchrun + 1 s.

    python benchmarks/startup.py                 # 5 rounds, ~3-6 minutes on 2 busy cores
    python benchmarks/startup.py --quick         # 1 round
    python benchmarks/startup.py --repeats 7 --json startup.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import _common as C  # noqa: E402

CONFIG = ROOT / "recipes" / "digits" / "config.yaml"
COMMANDS = ("spawned", "torchrun", "raw")
UNISON_PHASES = (
    "cli",
    "run",
    "config",
    "plan",
    "checks",
    "process_group",
    "rank_plan",
    "run_folder",
    "data",
    "model",
    "build",
    "first_batch",
    "first_iteration",
)
RAW_PHASES = ("imports", "process_group", "data", "model", "first_batch", "first_iteration")
TARGET_S = 1.0


def command(name: str, runs: Path) -> list[str]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    if name == "raw":
        return [*torchrun, str(HERE / "startup_raw_ddp.py"), "--iterations", "2"]
    recipe = ["run", str(CONFIG), "--set", "training.max_epochs=1", "--set", "training.epoch_length=2"]
    recipe += ["--set", f"logging.root={runs}"]
    if name == "spawned":
        return [sys.executable, "-m", "unison", *recipe, "--nproc", "2"]
    return [*torchrun, "-m", "unison", *recipe]


def read_trace(path: Path) -> dict[str, float]:
    """Seconds from ``launch`` to each phase: the latest process to reach it."""
    stamps: dict[str, float] = {}
    for line in path.read_text().splitlines():
        phase, when = line.split()[:2]
        stamps[phase] = max(stamps.get(phase, 0.0), float(when))
    launch = stamps.pop("launch")
    return {phase: t - launch for phase, t in stamps.items()}


def run_once(name: str, folder: Path, round_index: int) -> dict[str, float]:
    trace = folder / f"{name}-{round_index}.trace"
    runs = folder / "runs"
    env = dict(os.environ)
    env["UNISON_STARTUP_TRACE"] = str(trace)
    # the recipe's module (digits.py) and this checkout's unison, for every process
    paths = [str(CONFIG.parent), str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["CUDA_VISIBLE_DEVICES"] = ""  # ranks on the CPU, as the raw script's: on a GPU machine too
    with open(trace, "w") as fh:
        fh.write(f"launch {time.time():.6f} {os.getpid()} -\n")
    result = subprocess.run(
        command(name, runs), cwd=folder, env=env, capture_output=True, text=True, timeout=600
    )
    if result.returncode != 0:
        raise SystemExit(
            f"{name} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    shutil.rmtree(runs, ignore_errors=True)
    return read_trace(trace)


def phase_table(times: dict[str, list[dict[str, float]]]) -> list[list[str]]:
    """One row per phase: its own seconds (median over rounds) for each command that has it."""
    rows = []
    phases = list(UNISON_PHASES)
    phases.insert(0, "imports")
    for phase in phases:
        row = [phase]
        for name in COMMANDS:
            order = RAW_PHASES if name == "raw" else UNISON_PHASES
            if phase not in order:
                row.append("")
                continue
            i = order.index(phase)
            own = [t[phase] - (t[order[i - 1]] if i else 0.0) for t in times[name]]
            row.append(f"{C.median(own):.2f}")
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repeats", type=int, default=None, help="interleaved rounds (default 5; 1 with --quick)"
    )
    parser.add_argument("--quick", action="store_true", help="one round: a smoke run")
    parser.add_argument("--json", type=Path, default=None, help="write the report here, as JSON")
    args = parser.parse_args(argv)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 5)
    if repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {repeats}")
    env = C.environment("cpu")
    C.print_environment(env)
    folder = Path(tempfile.mkdtemp(prefix="unison-startup-"))
    times: dict[str, list[dict[str, float]]] = {name: [] for name in COMMANDS}
    try:
        for r in range(repeats):
            for name in C.rotated(COMMANDS, r):
                times[name].append(run_once(name, folder, r))
                print(
                    f"  round {r + 1}, {name}: first iteration at {times[name][-1]['first_iteration']:.2f} s",
                    flush=True,
                )
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    C.print_table(
        f"Seconds spent in each phase (median of {repeats} rounds; 2 ranks, the latest process to reach it)",
        ["phase", *COMMANDS],
        phase_table(times),
    )
    first = {name: [t["first_iteration"] for t in times[name]] for name in COMMANDS}
    over = {
        name: C.median(a - b for a, b in zip(first[name], first["raw"], strict=True)) for name in COMMANDS
    }
    C.print_table(
        "Launch to first iteration",
        ["command", "median s", "spread", "minus raw torchrun, s (paired)"],
        [[n, f"{C.median(first[n]):.2f}", f"{C.spread(first[n]):.2f}", f"{over[n]:+.2f}"] for n in COMMANDS],
    )
    targets = [
        C.judge(
            "unison run under torchrun: launch to first iteration <= raw torchrun + 1 s",
            over["torchrun"],
            TARGET_S,
        ),
        C.judge(
            "unison run --nproc 2 (spawned): launch to first iteration <= raw torchrun + 1 s",
            over["spawned"],
            TARGET_S,
        ),
    ]
    C.print_targets(targets)
    try:
        env["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    report = {
        "benchmark": "startup",
        **env,
        "quick": args.quick,
        "config": {"repeats": repeats, "commands": {n: command(n, Path("<runs>")) for n in COMMANDS}},
        "phases_s": times,
        "first_iteration_s": first,
        "minus_raw_s": over,
        "targets": targets,
    }
    C.write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
