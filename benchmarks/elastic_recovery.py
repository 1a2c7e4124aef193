"""How long an elastic torchrun job takes to recover from a fault, and the work it redoes.

Two real torchrun agents on this machine (node A hosts the c10d rendezvous store, node B
joins; ``--nnodes=1:2``, one gloo worker each, ``--monitor-interval=0.5``) train one epoch
of a tiny model (96 samples, 4 per rank and step) with a checkpoint every 4 iterations and
a sync point every iteration. Each fault lands at a fixed step (the runs of
tests/multinode/elastic_faults.py, the same as the tests):

    worker crash   B's worker SIGKILLs itself at step 7; both agents restart at 2 ranks
    node lost      B's agent and worker are SIGKILLed at step 7; A goes on alone
    node joins     A trains alone; B's agent starts at step 6; the group re-forms at 2
    agent SIGTERM  B's agent gets SIGTERM at step 6; both ranks save, A goes on alone

Measured, from the fault (the kill, B's start, the signal; a crash: the worker's own clock)
to A's agent logging "Rendezvous complete" (regrouped) and to the first training step after
it (recovered), and the iterations redone (completed after the checkpoint the next group
resumed). Every fault with the tuned rendezvous settings; the node loss also with torch's
defaults, to show what the settings buy.

    python benchmarks/elastic_recovery.py            # ~7 min on 2 busy CPU cores (1 repeat)
    python benchmarks/elastic_recovery.py --quick    # ~3 min: the tuned node loss and join only
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests"), str(HERE.parent / "tests" / "multinode")]

import _common as C  # noqa: E402

RUN_TIMEOUT_S = 400.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repeats", type=int, default=None, help="runs of each case (default 1; 1 with --quick)"
    )
    parser.add_argument("--quick", action="store_true", help="the tuned node loss and node join only")
    parser.add_argument("--json", type=Path, default=None, help="write the report here, as JSON")
    args = parser.parse_args(argv)
    repeats = args.repeats if args.repeats is not None else 1
    if repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {repeats}")

    import elastic_faults as F

    env = C.environment()
    C.print_environment(env)
    cases: list[tuple[str, Any, str, dict[str, int]]] = [
        ("node lost", F.node_lost, "tuned", F.TUNED),
        ("node joins", F.node_joins, "tuned", F.TUNED),
    ]
    if not args.quick:
        cases = [
            ("worker crash", F.worker_crash, "tuned", F.TUNED),
            *cases,
            ("agent SIGTERM", F.agent_sigterm, "tuned", F.TUNED),
            ("node lost", F.node_lost, "torch defaults", F.TORCH_DEFAULTS),
        ]
    print(f"tuned rendezvous: {F.TUNED}; monitor interval {F.MONITOR_INTERVAL} s; {repeats} repeat(s)")
    results = []
    with tempfile.TemporaryDirectory(prefix="elastic-recovery-") as tmp:
        for round_index in range(repeats):
            for name, run, settings, conf in C.rotated(cases, round_index):
                root = Path(tmp) / f"{name.replace(' ', '-')}-{settings.replace(' ', '-')}-{round_index}"
                root.mkdir()
                out = run(root, conf, timeout=RUN_TIMEOUT_S)
                if not out.after() or not out.resumed:
                    print(out.show())
                    raise SystemExit(f"{name} ({settings}): no step after the fault")
                row = {
                    "fault": name,
                    "rendezvous": settings,
                    "regrouped_s": out.regrouped_s(),
                    "recovered_s": out.recovery_s(),
                    "redone": out.redone(),
                    "world": f"{out.before()[0]['world']} -> {out.after()[0]['world']}",
                    "codes": out.codes,
                }
                print(f"  {name:13s} {settings:14s} regrouped {row['regrouped_s']:5.1f} s  "
                      f"recovered {row['recovered_s']:5.1f} s  redone {row['redone']}")  # fmt: skip
                results.append(row)

    summary = []
    for name, _, settings, _ in cases:
        rows = [r for r in results if r["fault"] == name and r["rendezvous"] == settings]
        summary.append(
            {
                "fault": name,
                "rendezvous": settings,
                "world": rows[0]["world"],
                "regrouped_s": C.median(r["regrouped_s"] for r in rows),
                "recovered_s": C.median(r["recovered_s"] for r in rows),
                "redone": max(r["redone"] for r in rows),
                "repeats": len(rows),
            }
        )
    C.print_table(
        "Recovery (median over repeats; seconds from the fault)",
        ["fault", "rendezvous", "world", "regrouped s", "first step s", "iterations redone"],
        [
            [
                s["fault"],
                s["rendezvous"],
                s["world"],
                f"{s['regrouped_s']:.1f}",
                f"{s['recovered_s']:.1f}",
                s["redone"],
            ]
            for s in summary
        ],
    )
    C.write_json(
        args.json,
        {
            "environment": env,
            "config": {"tuned": F.TUNED, "monitor_interval": F.MONITOR_INTERVAL, "repeats": repeats},
            "results": summary,
            "runs": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
