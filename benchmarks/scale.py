"""Scale, simulated: 2, 4, 8 and 16 gloo ranks on one machine, a tiny model; what a rank's
collectives, a save's gathers and a sync point cost as the world grows.

Each world size is one job (``launch``, its ranks forked from one fork server that imported
torch once; gloo, one torch thread per rank) running
``_scale_worker.rank_worker``: ``Linear(8, 2)`` in DDP, batches of 4 per rank, one epoch of
``--iters`` iterations with a sync point every ``--sync-every``, then one evaluation
(Accuracy and Loss), one checkpoint save (model, SGD, trainer, data position, every rank's
RNG states), then ``--calls`` sync points, and as many bare all-reduces of 4 float64 (what a sync point\nadds to the collective), timed in ``--repeats`` interleaved blocks. Counted on every
rank: unison's collectives per iteration (outside sync points), per sync point (in an
epoch and at its end), per evaluation and per save; the pickled bytes each rank sends in a
save's object gathers, and their sum over ranks (what rank 0 receives). Timed: a sync
point's median call, the slowest rank's, median over blocks.

What should hold: every count the same at every world size (the rule that a rank's
collectives do not grow with the world); the bytes a rank sends per save constant, rank 0
receiving W times that; the sync point's time growing no faster than the all-reduce's own
(on one machine of few cores, W ranks also share the cores: read the time on a machine
with at least W cores).

    python benchmarks/scale.py                             # 2 4 8 16 ranks; ~2 min on 16 cores
    python benchmarks/scale.py --ranks 2 4 --quick         # a smoke run
    python benchmarks/scale.py --plot docs/img/scale.png --json scale.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _common as C  # noqa: E402
from _scale_worker import rank_worker  # noqa: E402

RANKS = (2, 4, 8, 16)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Counts, bytes and sync-point time against the world size: three panels, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator

    worlds = [r["world_size"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    counts = axes[0]
    for key, label, style in (
        ("collectives_per_iteration", "per iteration", "o-"),
        ("collectives_per_sync_point", "per sync point", "s-"),
        ("collectives_per_evaluation", "per evaluation", "x--"),
        ("collectives_per_save", "per save", "^-"),
    ):
        counts.plot(worlds, [r[key] for r in results], style, label=label, markersize=8)
    counts.set(title="unison's collectives, per rank", ylabel="calls", ylim=(-0.3, 3.3))
    counts.legend(fontsize=8)
    sent = axes[1]
    sent.plot(worlds, [r["save_bytes_per_rank"] / 1e3 for r in results], "o-", label="sent by each rank")
    sent.plot(worlds, [r["save_bytes_total"] / 1e3 for r in results], "s-", label="received by rank 0")
    sent.set(title="object gathers of one save", ylabel="kB")
    sent.legend(fontsize=8)
    timed = axes[2]
    timed.plot(worlds, [r["sync_point_us"] for r in results], "o-", label="sync point")
    timed.plot(worlds, [r["all_reduce_us"] for r in results], "s--", label="bare all_reduce (4 floats)")
    timed.set(title="time, median call (slowest rank)", ylabel="us")
    timed.legend(fontsize=8)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(worlds))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([str(w) for w in worlds])
        ax.set_xlabel("ranks (gloo, one machine)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def summary(out: dict[str, Any]) -> dict[str, Any]:
    syncs = set(out["collectives_per_sync_point"])
    return {
        "world_size": out["world_size"],
        "iterations": out["iterations"],
        "collectives_per_iteration": out["collectives_per_iteration"],
        "collectives_per_sync_point": max(syncs) if syncs else 0,
        "sync_points_counted": len(out["collectives_per_sync_point"]),
        "collectives_per_epoch_end": max(out["collectives_per_epoch_end"]),
        "collectives_per_evaluation": out["collectives_per_evaluation"],
        "collectives_per_save": out["collectives_per_save"],
        "save_calls": out["save_calls"],
        "save_bytes_per_rank": out["save_bytes_sent_by_this_rank"],
        "save_bytes_total": out["save_bytes_sent_by_all_ranks"],
        "sync_point_us": C.median(out["sync_point_s"]) * 1e6,
        "all_reduce_us": C.median(out["all_reduce_s"]) * 1e6,
        "sync_point_spread": C.spread(out["sync_point_s"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ranks", nargs="+", type=int, default=list(RANKS), help="world sizes (default 2 4 8 16)"
    )
    parser.add_argument("--iters", type=int, default=12, help="iterations of the epoch (default 12)")
    parser.add_argument("--sync-every", type=int, default=4, help="sync point every N iterations (default 4)")
    parser.add_argument(
        "--calls", type=int, default=None, help="sync points per timed block (default 40; 10 quick)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed blocks (default 7; 2 quick)")
    parser.add_argument("--quick", action="store_true", help="fewer timed sync points: a smoke run")
    parser.add_argument("--plot", type=Path, default=None, help="write the figure here (PNG)")
    parser.add_argument("--json", type=Path, default=None, help="write the report here, as JSON")
    args = parser.parse_args(argv)
    if any(w < 2 for w in args.ranks):
        raise SystemExit(f"--ranks must be >= 2 (a world of one has no collective), got {args.ranks}")
    from unison.distributed import launch
    from unison.distributed.fork_server import start_fork_server

    start_fork_server()  # every world size's ranks fork from one process that imported torch once

    env = C.environment("cpu")
    C.print_environment(env)
    folder = Path(tempfile.mkdtemp(prefix="unison-scale-"))
    cfg = {
        "folder": str(folder),
        "iters": args.iters,
        "sync_every": args.sync_every,
        "batch": 4,
        "calls": args.calls or (10 if args.quick else 40),
        "repeats": args.repeats or (2 if args.quick else 7),
    }
    results = []
    try:
        for world in args.ranks:
            outs = launch(
                rank_worker, cfg, nproc_per_node=world, backend="gloo", start_method="forkserver", timeout=600
            )
            ranks = [summary(o) for o in outs]
            counts = ("collectives_per_iteration", "collectives_per_sync_point", "collectives_per_evaluation")
            for key in (*counts, "collectives_per_save", "save_bytes_total"):
                if len({r[key] for r in ranks}) != 1:
                    raise SystemExit(f"{world} ranks: {key} differs between ranks: {[r[key] for r in ranks]}")
            results.append(ranks[0])
            print(f"  {world} ranks: sync point {ranks[0]['sync_point_us']:.0f} us", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    C.print_table(
        f"Per rank, one epoch of {args.iters} iterations (sync every {args.sync_every}), one evaluation, one save",
        [
            "ranks",
            "per iteration",
            "per sync point",
            "per epoch end",
            "per evaluation",
            "per save",
            "save: B sent/rank",
            "B to rank 0",
            "sync point us",
            "all_reduce us",
        ],
        [
            [
                r["world_size"],
                r["collectives_per_iteration"],
                r["collectives_per_sync_point"],
                r["collectives_per_epoch_end"],
                r["collectives_per_evaluation"],
                r["collectives_per_save"],
                r["save_bytes_per_rank"],
                r["save_bytes_total"],
                f"{r['sync_point_us']:.0f}",
                f"{r['all_reduce_us']:.0f}",
            ]
            for r in results
        ],
    )
    first = results[0]
    targets = []
    for key in (
        "collectives_per_iteration",
        "collectives_per_sync_point",
        "collectives_per_epoch_end",
        "collectives_per_evaluation",
        "collectives_per_save",
    ):
        grows = max(r[key] for r in results) - first[key]
        targets.append(
            C.judge(
                f"{key.replace('_', ' ')}: the same at every world size",
                grows,
                0,
                counts=[r[key] for r in results],
            )
        )
    per_rank = [r["save_bytes_per_rank"] for r in results]
    targets.append(
        C.judge(
            "save: bytes each rank sends, at most 10% over the smallest world's",
            max(per_rank) / per_rank[0],
            1.1,
        )
    )
    C.print_targets(targets)
    if args.plot is not None:
        plot(results, args.plot)
    try:
        env["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    C.write_json(
        args.json,
        {
            "benchmark": "scale",
            **env,
            "quick": args.quick,
            "config": {**cfg, "folder": None},
            "results": results,
            "targets": targets,
        },
    )
    return 0 if all(t["met"] for t in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
