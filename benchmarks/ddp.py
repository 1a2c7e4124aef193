"""Data-parallel training: a raw DDP loop against unison, in throughput and in start-up time.

Throughput: one job of N ranks (2 gloo processes on the CPU, one per GPU with NCCL)
trains the MLP 784-512-512-10 (batch 64 per rank, SGD, cross-entropy) two ways, epoch
after epoch, interleaved, with the order rotated every round:

    raw     DistributedSampler + set_epoch, DataLoader, DDP model, a hand-written loop
    unison  prepare_loaders, prepare_model, create_trainer (defaults: sync_every=100, the
            epoch loss tracked), trainer.run

Both see the same dataset, batch size and model; an epoch is long enough to hold one of
unison's mid-epoch sync points. Each epoch's time is the slowest rank's; the table gives
iterations per second per rank (median over rounds) and the median of the per-round
ratios unison / raw; and the median iteration (the clock is read as each batch is drawn,
by both loops alike; the slowest rank's median), which a burst of load from another job
moves little, and on which the 3% target is judged (with a bootstrap 95% interval). The
median iteration leaves out the one sync point per epoch: sync_point.py measures it.

Start-up: fresh processes, launched by torchrun (or spawned, with --launcher spawn),
run until their first training iteration is done; each rank stamps when its process
started, when torch was imported, when the library was (raw: torch.distributed, DDP,
DataLoader; unison: unison, which imports ignite), when it was ready (process group,
loader, model wrapped in DDP, trainer) and when its first iteration ended. The slowest
rank counts. Phases shift with what imports what first (building the first DDP model
imports torch._dynamo, ~800 modules, unless something did earlier): compare totals.
With --launcher spawn, the launching script imports torch (raw) or unison, and a spawned
rank's imports all fall in "import_torch" (unpickling its function imports them).

    python benchmarks/ddp.py                # ~2 minutes on 2 busy CPU cores
    python benchmarks/ddp.py --quick        # throughput only, ~30 s
    python benchmarks/ddp.py --nproc 2 --repeats 15 --json out.json
"""

from __future__ import annotations

import time

T_MAIN = time.time()  # a start-up worker's first statement: when this script began to run

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

SCRIPT = Path(__file__).resolve()
BATCH = 64
ITERS = 105  # iterations per rank per epoch: one mid-epoch sync point, at iteration 100
QUICK_ITERS = 30
STARTUP_REPEATS, QUICK_STARTUP_REPEATS = 2, 0  # fresh launches per variant; --quick skips them


# -- throughput ---------------------------------------------------------------------------


def throughput_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """Runs on every rank: the raw loop and unison's trainer, epoch after epoch, interleaved."""
    import torch
    from torch.nn import functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from unison.distributed import device as rank_device
    from unison.distributed import get_world_size, prepare_loaders, prepare_model
    from unison.engine import create_trainer

    device = rank_device()
    if device.type == "cpu":
        torch.set_num_threads(cfg["threads"])
    amp, iters = cfg["amp"], cfg["iters"]
    dataset = C.classification_data(iters * BATCH * get_world_size())

    raw_model = C.build_mlp(seed=0).to(device)
    if get_world_size() > 1:  # as prepare_model does: no DDP wrapper for a single rank
        raw_model = DistributedDataParallel(
            raw_model, device_ids=[device.index] if device.type == "cuda" else None
        )
    raw_opt = torch.optim.SGD(raw_model.parameters(), lr=0.01)
    raw_sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    raw_loader = DataLoader(dataset, batch_size=BATCH, sampler=raw_sampler)
    epoch = [0]

    def raw_epoch(limit: int | None = None) -> Any:
        clocked = C.Clocked(raw_loader)

        def run() -> None:
            raw_sampler.set_epoch(epoch[0])
            epoch[0] += 1
            raw_model.train()
            for i, (x, y) in enumerate(clocked):
                if limit is not None and i >= limit:
                    break
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                raw_opt.zero_grad(set_to_none=True)
                with C.autocast(device.type, amp):
                    loss = F.cross_entropy(raw_model(x), y)
                loss.backward()
                raw_opt.step()

        return run, clocked

    train_loader, _ = prepare_loaders(dataset, batch_size=BATCH, seed=0)
    model = prepare_model(C.build_mlp(seed=0))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def unison_epoch(limit: int | None = None) -> Any:
        trainer = create_trainer(model, opt, F.cross_entropy, amp=amp)
        clocked = C.Clocked(train_loader)  # the engine finds the sampler through it
        return lambda: trainer.run(clocked, max_epochs=1, epoch_length=limit), clocked

    def timed(run_and_clock: Any) -> list[float]:
        run, clocked = run_and_clock
        wall, cpu = C.timed_block(run, device)
        return [wall, cpu, *C.slowest([clocked.median_interval()], device)]

    # warm-up: allocator, DDP's bucket rebuild on the first iterations, caches
    timed(raw_epoch(limit=10))
    timed(unison_epoch(limit=10))
    times: dict[str, list[list[float]]] = {"raw": [], "unison": []}
    for r in range(cfg["repeats"]):
        for variant in C.rotated(["raw", "unison"], r):
            times[variant].append(timed(raw_epoch() if variant == "raw" else unison_epoch()))
    return {"iterations_per_epoch": len(raw_loader), "unison_iterations": len(train_loader), "times": times}


def measure_throughput(cfg: dict[str, Any]) -> dict[str, Any]:
    from unison.distributed import launch

    out = launch(
        throughput_worker, cfg, nproc_per_node=cfg["nproc"], backend=cfg["backend"], start_method="spawn"
    )[0]
    n = out["iterations_per_epoch"]
    assert out["unison_iterations"] == n, out
    wall = {v: [t[0] for t in ts] for v, ts in out["times"].items()}
    cpu = {v: [t[1] for t in ts] for v, ts in out["times"].items()}
    iteration = {v: [t[2] for t in ts] for v, ts in out["times"].items()}
    rows = {}
    for v in wall:
        rows[v] = {
            "median_epoch_s": C.median(wall[v]),
            "iterations_per_second": n / C.median(wall[v]),
            "samples_per_second_all_ranks": n * BATCH * cfg["nproc"] / C.median(wall[v]),
            "ratio_to_raw": C.paired_ratio(wall[v], wall["raw"]),
            "spread": C.spread(wall[v]),
            "median_iteration_ms": C.median(iteration[v]) * 1e3,
            "iteration_ratio_to_raw": C.paired_ratio(iteration[v], iteration["raw"]),
            "iteration_spread": C.spread(iteration[v]),
            "cpu_median_epoch_s": C.median(cpu[v]),
            "cpu_ratio_to_raw": C.paired_ratio(cpu[v], cpu["raw"]),
            "epoch_s": wall[v],
            "median_iteration_s_each_epoch": iteration[v],
        }
    return {"iterations_per_epoch": n, "batch_per_rank": BATCH, "repeats": cfg["repeats"], "results": rows}


# -- start-up -----------------------------------------------------------------------------


def _process_start() -> float | None:
    """When this process was started (epoch seconds, ~10 ms resolution; Linux only)."""
    try:
        with open("/proc/self/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        started_ticks = int(fields[19])  # field 22 of stat(5), counted after "pid (comm)"
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return time.time() - (uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _write_stamps(stamps: dict[str, Any], out_dir: str, kind: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    Path(out_dir, f"{kind}-rank{rank}.json").write_text(json.dumps(stamps))


def raw_startup_rank(out_dir: str, cfg: dict[str, Any], stamps: dict[str, Any]) -> None:
    """A raw DDP script, up to its first iteration. RANK etc. come from the launcher."""
    import torch

    stamps.setdefault("torch_imported", time.time())
    import torch.distributed as dist
    from torch.nn import functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    stamps.setdefault("imported", time.time())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cfg["backend"] == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(cfg["backend"])
    dataset = C.classification_data(cfg["startup_samples"])
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    sampler.set_epoch(0)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    model = C.build_mlp(seed=0).to(device)
    if dist.get_world_size() > 1:
        model = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stamps["ready"] = time.time()
    model.train()
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        with C.autocast(device.type, cfg["amp"]):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        break
    C.synchronize(device)
    stamps["first_iteration"] = time.time()
    _write_stamps(stamps, out_dir, "raw")
    dist.destroy_process_group()


def unison_startup_body(out_dir: str, cfg: dict[str, Any], stamps: dict[str, Any]) -> None:
    """The body of a unison script (what launch() runs on every rank), up to its first iteration."""
    stamps.setdefault("main", T_MAIN)  # spawned ranks: when this module was imported in them
    stamps.setdefault("process_start", _process_start())
    stamps.setdefault("torch_imported", time.time())
    stamps.setdefault("imported", time.time())
    import torch
    from torch.nn import functional as F

    from unison.distributed import device as rank_device
    from unison.distributed import prepare_loaders, prepare_model
    from unison.engine import Events, create_trainer

    dataset = C.classification_data(cfg["startup_samples"])
    loader, _ = prepare_loaders(dataset, batch_size=BATCH, seed=0)
    model = prepare_model(C.build_mlp(seed=0))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = create_trainer(model, opt, F.cross_entropy, amp=cfg["amp"])
    stamps["ready"] = time.time()

    def first(_: Any) -> None:
        C.synchronize(rank_device())
        stamps["first_iteration"] = time.time()

    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=1), first)
    trainer.run(loader, max_epochs=1, epoch_length=1)
    _write_stamps(stamps, out_dir, "unison")


def unison_startup_rank(out_dir: str, cfg: dict[str, Any], stamps: dict[str, Any]) -> None:
    """A unison script under torchrun: import, then launch() (which creates the group)."""
    import torch  # noqa: F401

    stamps["torch_imported"] = time.time()
    import unison  # noqa: F401  (ignite comes with it)
    from unison.distributed import launch

    stamps["imported"] = time.time()
    launch(unison_startup_body, out_dir, cfg, stamps, backend=cfg["backend"])


def _raw_spawned(local_rank: int, out_dir: str, cfg: dict[str, Any], port: int) -> None:
    stamps = {"main": T_MAIN, "process_start": _process_start()}
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(cfg["nproc"]),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    raw_startup_rank(out_dir, cfg, stamps)


def startup_entry(kind: str, launcher: str, out_dir: str, cfg: dict[str, Any]) -> None:
    """What the fresh process runs: a rank (torchrun) or the script that spawns the ranks."""
    if launcher == "torchrun":
        stamps = {"main": T_MAIN, "process_start": _process_start()}
        (raw_startup_rank if kind == "raw" else unison_startup_rank)(out_dir, cfg, stamps)
        return
    if kind == "raw":
        import torch.multiprocessing as mp

        from unison.distributed.env import find_free_port  # a socket call; raw scripts pick a port too

        mp.start_processes(
            _raw_spawned, args=(out_dir, cfg, find_free_port()), nprocs=cfg["nproc"], start_method="spawn"
        )
    else:
        from unison.distributed import launch

        launch(unison_startup_body, out_dir, cfg, {}, nproc_per_node=cfg["nproc"], backend=cfg["backend"])


def measure_startup(kind: str, cfg: dict[str, Any]) -> dict[str, float]:
    """Launches fresh processes once; returns the phases in seconds (slowest rank)."""
    launcher = cfg["launcher"]
    with tempfile.TemporaryDirectory(prefix="unison-bench-startup-") as out_dir:
        env = dict(os.environ, OMP_NUM_THREADS=str(cfg["threads"]), PYTHONUNBUFFERED="1")
        args = ["--startup-worker", kind, "--startup-dir", out_dir, "--startup-cfg", json.dumps(cfg)]
        if launcher == "torchrun":
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={cfg['nproc']}",
            ]
            cmd += [str(SCRIPT), *args]
        else:
            cmd = [sys.executable, str(SCRIPT), *args]
        launched = time.time()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        exited = time.time()
        if proc.returncode != 0:
            raise RuntimeError(
                f"start-up run {kind} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
            )
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob(f"{kind}-rank*.json"))]
    if len(ranks) != cfg["nproc"]:
        raise RuntimeError(f"start-up run {kind}: {len(ranks)} of {cfg['nproc']} ranks reported")

    def last(key: str) -> float:
        return max(r[key] for r in ranks if r.get(key) is not None)

    started = last("process_start") if all(r.get("process_start") for r in ranks) else last("main")
    return {
        "launch_to_rank_start": started - launched,
        "import_torch": last("torch_imported") - started,
        "import_library": last("imported") - last("torch_imported"),
        "setup_to_ready": last("ready") - last("imported"),
        "first_iteration": last("first_iteration") - last("ready"),
        "launch_to_first_iteration": last("first_iteration") - launched,
        "launch_to_exit": exited - launched,
    }


# -- main ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_common_args(parser, repeats=15, quick_repeats=2)
    parser.add_argument(
        "--nproc", type=int, default=None, help="ranks; default 2 on the CPU, every GPU on CUDA"
    )
    parser.add_argument(
        "--launcher", choices=["torchrun", "spawn"], default="torchrun", help="for start-up runs"
    )
    parser.add_argument(
        "--startup-repeats",
        type=int,
        default=None,
        help=f"fresh launches per variant (default {STARTUP_REPEATS}; 0, none, with --quick)",
    )
    parser.add_argument("--startup-worker", choices=["raw", "unison"], help=argparse.SUPPRESS)
    parser.add_argument("--startup-dir", help=argparse.SUPPRESS)
    parser.add_argument("--startup-cfg", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.startup_worker:
        cfg = json.loads(args.startup_cfg)
        startup_entry(args.startup_worker, cfg["launcher"], args.startup_dir, cfg)
        return 0

    repeats = C.resolve_repeats(args)
    import torch

    device = C.resolve_device(args.device)
    amp = C.resolve_amp(args.amp, device)
    if device == "cuda":
        nproc = args.nproc or torch.cuda.device_count()
        if nproc > torch.cuda.device_count():
            raise SystemExit(
                f"--nproc {nproc} with NCCL needs as many GPUs; {torch.cuda.device_count()} visible."
            )
    else:
        nproc = args.nproc or 2
    cfg = {
        "nproc": nproc,
        "backend": "nccl" if device == "cuda" else "gloo",
        "threads": C.rank_threads(nproc),
        "amp": amp,
        "iters": QUICK_ITERS if args.quick else ITERS,
        "repeats": repeats,
        "launcher": args.launcher,
        "startup_samples": BATCH * nproc * 4,
    }
    report: dict[str, Any] = {"benchmark": "ddp", **C.environment(device), "quick": args.quick, "config": cfg}
    C.print_environment(report)
    if nproc < 2:
        print("one rank: neither loop wraps the model in DDP (NCCL needs one GPU per rank)")

    result = measure_throughput(cfg)
    report["throughput"] = result
    rows = result["results"]
    C.print_table(
        f"throughput: {nproc} {cfg['backend']} ranks, MLP, batch {BATCH}/rank, {result['iterations_per_epoch']} "
        f"iterations/epoch, {repeats} interleaved epochs each (medians; x raw: median of paired ratios)",
        [
            "loop",
            "it/s per rank",
            "epoch s",
            "x raw",
            "spread",
            "median it ms",
            "x raw",
            "spread",
            "cpu x raw",
        ],
        [
            [
                v,
                f"{r['iterations_per_second']:.1f}",
                f"{r['median_epoch_s']:.3f}",
                f"{r['ratio_to_raw']:.3f}",
                f"{r['spread']:.2f}",
                f"{r['median_iteration_ms']:.2f}",
                f"{r['iteration_ratio_to_raw']:.3f}",
                f"{r['iteration_spread']:.2f}",
                f"{r['cpu_ratio_to_raw']:.3f}",
            ]
            for v, r in rows.items()
        ],
    )
    report["targets"] = [
        C.judge(
            "unison within 3% of raw DDP (median iteration, x raw)",
            rows["unison"]["iteration_ratio_to_raw"],
            1.03,
            C.ratio_ci(
                rows["unison"]["median_iteration_s_each_epoch"], rows["raw"]["median_iteration_s_each_epoch"]
            ),
            epoch_time_x_raw=round(rows["unison"]["ratio_to_raw"], 3),
            epoch_time_ci95=[
                round(x, 3) for x in C.ratio_ci(rows["unison"]["epoch_s"], rows["raw"]["epoch_s"])
            ],
        )
    ]

    n = (
        args.startup_repeats
        if args.startup_repeats is not None
        else (QUICK_STARTUP_REPEATS if args.quick else STARTUP_REPEATS)
    )
    if n < 1:
        print("\nstart-up: skipped (--quick, or --startup-repeats 0)")
    else:
        runs: dict[str, list[dict[str, float]]] = {"raw": [], "unison": []}
        for r in range(n):
            for kind in C.rotated(["raw", "unison"], r):
                runs[kind].append(measure_startup(kind, cfg))
        phases = list(runs["raw"][0])
        startup = {kind: {p: C.median(x[p] for x in values) for p in phases} for kind, values in runs.items()}
        report["startup"] = {"launcher": args.launcher, "repeats": n, "median_s": startup, "runs": runs}
        C.print_table(
            f"start-up to the first iteration: {args.launcher}, {nproc} ranks, {n} fresh launch(es) each "
            "(medians, seconds, slowest rank)",
            ["phase", "raw", "unison", "unison - raw"],
            [
                [
                    p,
                    f"{startup['raw'][p]:.2f}",
                    f"{startup['unison'][p]:.2f}",
                    f"{startup['unison'][p] - startup['raw'][p]:+.2f}",
                ]
                for p in phases
            ],
        )
    C.print_targets(report["targets"])
    C.write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
