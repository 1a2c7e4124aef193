"""The cost of a unison sync point, and its share of an MLP training step in DDP.

N ranks (2 gloo processes on the CPU, one per GPU with NCCL). Three measurements:

1. Isolated, back-to-back calls (``--calls`` per block, blocks interleaved; each call
   timed, the block's median call kept, so a burst of load moves it little):
       trainer sync point          ``Engine._sync`` of a default create_trainer: the stop
                                   requests (what rides every ``sync_every`` iterations)
       + NonFiniteGuard, TimeLimit the same with the two usual guards attached
       epoch-end sync point        ``_sync(epoch_end=True)``: adds the epoch's loss
       all_reduce 1 x 4 float64    one all-reduce of a 4-element tensor
       all_reduce 4 x 1 float64    four all-reduces of one element each
2. In the loop: a DDP trainer of the MLP 784-512-512-10 (batch 64 per rank) with
   ``sync_every=1``, each ``_sync`` call timed where it happens (cold caches, ranks
   arriving from their own step), against the same trainer with ``sync_every=None``,
   whose time per iteration is the step. Share at ``sync_every=k``: sync / (k x step).
3. At world size 1 (this process, CPU time): ``Engine._sync`` of a bare Engine, which
   still builds and reads back the stop-request tensor.

    python benchmarks/sync_point.py          # ~30 s on 2 busy CPU cores
    python benchmarks/sync_point.py --quick  # ~20 s
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

BATCH = 64
SYNC_EVERY = (1, 10, 100)


def worker(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.nn import functional as F

    from unison.distributed import device as rank_device
    from unison.distributed import get_rank, prepare_model
    from unison.engine import create_trainer
    from unison.handlers import NonFiniteGuard, TimeLimit

    device = rank_device()
    if device.type == "cpu":
        torch.set_num_threads(cfg["threads"])
    amp = cfg["amp"]
    comm = C.comm_device(device)
    gen = torch.Generator().manual_seed(get_rank())
    batches = [
        (
            torch.randn(BATCH, 784, generator=gen).to(device),
            torch.randint(0, 10, (BATCH,), generator=gen).to(device),
        )
        for _ in range(cfg["iters"])
    ]
    model = prepare_model(C.build_mlp(seed=0))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def trainer(sync_every: int | None = 100, guards: bool = False) -> Any:
        engine = create_trainer(model, opt, F.cross_entropy, amp=amp, sync_every=sync_every)
        if guards:
            NonFiniteGuard().attach(engine)
            TimeLimit(seconds=1e9).attach(engine)
        return engine

    # 1. isolated
    plain, guarded = trainer(), trainer(guards=True)
    for t in (plain, guarded):
        t.run(batches[:3], max_epochs=1)  # state, an epoch loss, warm DDP
    one = torch.ones(4, dtype=torch.float64, device=comm)
    singles = [torch.ones(1, dtype=torch.float64, device=comm) for _ in range(4)]

    def one_x4() -> None:
        dist.all_reduce(one)

    def four_x1() -> None:
        for t in singles:
            dist.all_reduce(t)

    micro = {
        "trainer sync point": lambda: plain._sync(epoch_end=False),
        "+ NonFiniteGuard, TimeLimit": lambda: guarded._sync(epoch_end=False),
        "epoch-end sync point": lambda: plain._sync(epoch_end=True),
        "all_reduce 1 x 4 float64": one_x4,
        "all_reduce 4 x 1 float64": four_x1,
    }
    calls = cfg["calls"]

    def block(fn: Any, spent: list[float]) -> Any:
        def run() -> None:
            for _ in range(calls):
                start = time.perf_counter()
                fn()
                C.synchronize(device)  # NCCL collectives return before they are done
                spent.append(time.perf_counter() - start)

        return run

    for fn in micro.values():  # warm-up
        C.timed_block(block(fn, []), device)
    isolated: dict[str, list[float]] = {k: [] for k in micro}
    isolated_mean: dict[str, list[float]] = {k: [] for k in micro}
    for r in range(cfg["repeats"]):
        for name in C.rotated(list(micro), r):
            spent: list[float] = []
            wall = C.timed_block(block(micro[name], spent), device)[0]
            isolated[name].append(C.slowest([C.median(spent)], device)[0])
            isolated_mean[name].append(wall / calls)

    # 2. in the loop
    in_loop: list[float] = []
    step: dict[str, list[float]] = {"sync_every=None": [], "sync_every=1": []}
    for r in range(cfg["loop_repeats"] + 1):  # the first round warms up
        for variant in C.rotated(list(step), r):
            engine = trainer(sync_every=None if variant == "sync_every=None" else 1)
            spent: list[float] = []
            if variant == "sync_every=1":
                original = engine._sync

                def timed_sync(epoch_end: bool, original: Any = original, spent: list = spent) -> None:
                    start = time.perf_counter()
                    original(epoch_end)
                    C.synchronize(device)
                    spent.append(time.perf_counter() - start)

                engine._sync = timed_sync  # what Engine._fire_event calls
            wall, _ = C.timed_block(lambda engine=engine: engine.run(batches, max_epochs=1), device)
            if r == 0:
                continue
            step[variant].append(wall / len(batches))
            if spent:
                in_loop.extend(C.slowest(spent[:-1], device))  # the last is the epoch's end
    return {"isolated": isolated, "isolated_mean": isolated_mean, "in_loop_sync": in_loop, "step": step}


def world_size_one(repeats: int, calls: int) -> dict[str, float]:
    """CPU time of a sync point with no process group (single-process training)."""
    from unison.engine import Engine

    engine = Engine(lambda _, batch: batch)
    engine.run([0, 1, 2])
    values = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(calls):
            engine._sync(epoch_end=False)
        values.append((time.process_time() - start) / calls)
    return {"median_us": C.median(values) * 1e6, "min_us": min(values) * 1e6}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_common_args(parser, repeats=15, quick_repeats=3)
    parser.add_argument(
        "--nproc", type=int, default=None, help="ranks; default 2 on the CPU, every GPU on CUDA"
    )
    parser.add_argument(
        "--calls", type=int, default=None, help="calls per isolated block (default 40; 10 quick)"
    )
    args = parser.parse_args(argv)
    repeats = C.resolve_repeats(args)

    import torch

    from unison.distributed import launch

    device = C.resolve_device(args.device)
    nproc = args.nproc or (torch.cuda.device_count() if device == "cuda" else 2)
    calls = args.calls or (10 if args.quick else 40)
    cfg = {
        "nproc": nproc,
        "backend": "nccl" if device == "cuda" else "gloo",
        "threads": C.rank_threads(nproc),
        "amp": C.resolve_amp(args.amp, device),
        "repeats": repeats,
        "calls": calls,
        "iters": 12 if args.quick else 30,
        "loop_repeats": 2 if args.quick else 6,
    }
    report: dict[str, Any] = {
        "benchmark": "sync_point",
        **C.environment(device),
        "quick": args.quick,
        "config": cfg,
    }
    C.print_environment(report)
    single = world_size_one(repeats, 200)
    out = launch(worker, cfg, nproc_per_node=nproc, backend=cfg["backend"], start_method="spawn")[0]

    isolated = {
        k: {
            "median_us": C.median(v) * 1e6,
            "spread": C.spread(v),
            "mean_us": C.median(out["isolated_mean"][k]) * 1e6,
            "median_us_each_block": [x * 1e6 for x in v],
        }
        for k, v in out["isolated"].items()
    }
    step_s = C.median(out["step"]["sync_every=None"])
    # One rank (one GPU) has no sync point inside an epoch: nothing to agree on, so the engine skips them.
    loop_sync_s = C.median(out["in_loop_sync"]) if out["in_loop_sync"] else None
    direct_s = C.median(out["step"]["sync_every=1"]) - step_s
    sync_s = isolated["trainer sync point"]["median_us"] * 1e-6
    shares = {
        k: {
            "isolated_percent": 100 * sync_s / (k * step_s),
            "in_loop_percent": None if loop_sync_s is None else 100 * loop_sync_s / (k * step_s),
        }
        for k in SYNC_EVERY
    }
    report.update(
        {
            "isolated_us": isolated,
            "world_size_1_sync_point_cpu_us": single,
            "mlp_step_ms": step_s * 1e3,
            "in_loop_sync_point_us": None if loop_sync_s is None else loop_sync_s * 1e6,
            "in_loop_sync_point_count": len(out["in_loop_sync"]),
            "sync_every_1_minus_none_us_per_iteration": direct_s * 1e6,
            "share_of_step": shares,
            "steps": {k: [x * 1e3 for x in v] for k, v in out["step"].items()},
        }
    )
    C.print_table(
        f"isolated: {nproc} {cfg['backend']} ranks, {calls} back-to-back calls x {repeats} interleaved blocks "
        "(median call of each block, slowest rank; median over blocks)",
        ["what", "us per call", "spread", "mean us"],
        [
            [k, f"{v['median_us']:.0f}", f"{v['spread']:.2f}", f"{v['mean_us']:.0f}"]
            for k, v in isolated.items()
        ]
        + [["world size 1: Engine._sync (cpu)", f"{single['median_us']:.0f}", "", ""]],
    )
    in_loop_text = (
        "n/a (one rank: no sync point inside an epoch)"
        if loop_sync_s is None
        else f"{loop_sync_s * 1e6:.0f} us"
    )
    C.print_table(
        f"in the loop: MLP DDP step {step_s * 1e3:.2f} ms; sync point timed where it runs "
        f"(sync_every=1, {len(out['in_loop_sync'])} calls) {in_loop_text}; run time "
        f"difference sync_every=1 - None: {direct_s * 1e6:.0f} us/iteration",
        ["sync_every", "share (isolated)", "share (in loop)"],
        [
            [
                k,
                f"{v['isolated_percent']:.3f}%",
                "n/a" if v["in_loop_percent"] is None else f"{v['in_loop_percent']:.3f}%",
            ]
            for k, v in shares.items()
        ],
    )
    four_x1 = isolated["all_reduce 4 x 1 float64"]["median_us"]
    one_x4 = isolated["all_reduce 1 x 4 float64"]["median_us"]
    report["targets"] = [
        {
            "target": "sync point at sync_every=100 < 1% of an MLP DDP step",
            "percent_in_loop": None if loop_sync_s is None else round(shares[100]["in_loop_percent"], 4),
            "percent_isolated": round(shares[100]["isolated_percent"], 4),
            "met": max(
                v for v in (shares[100]["in_loop_percent"], shares[100]["isolated_percent"]) if v is not None
            )
            < 1.0,
        },
        {
            "target": "one 4-element all-reduce cheaper than four scalar ones",
            "one_x4_us": round(one_x4, 1),
            "four_x1_us": round(four_x1, 1),
            "met": one_x4 < four_x1,
        },
    ]
    C.print_targets(report["targets"])
    C.write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
