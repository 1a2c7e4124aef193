"""Sharded training (FSDP2): its cost per iteration, its memory per rank and its checkpoints,
side by side with raw PyTorch loops and with DDP.

One job of N ranks (2 gloo processes on the CPU, one per GPU with NCCL) trains the MLP
784-512-512-10 (batch 64 per rank, AdamW, cross-entropy) four ways, epoch after epoch,
interleaved, with the order rotated every round:

    raw DDP       DistributedSampler + set_epoch, DataLoader, DDP model, a hand-written loop
    unison DDP    prepare_loaders, prepare_model, create_trainer, trainer.run
    raw FSDP      the same hand-written loop; fully_shard on each Linear, then on the root
    unison FSDP   prepare_model(strategy="fsdp") (its "auto" rule takes the same units),
                  create_trainer, trainer.run

Time: the median iteration (the clock is read as each batch is drawn, by every loop
alike; the slowest rank's median), as in ddp.py, and the whole epoch. Ratios are medians
over rounds of paired ratios: unison FSDP / raw FSDP is the framework's cost on top of
sharding (target: within 3%, with a bootstrap 95% interval); FSDP / DDP is what sharding
costs on this hardware (an all-gather per unit in forward and in backward and a
reduce-scatter per unit, against one all-reduce).

Memory, counted, not timed: the bytes of parameters, gradients and optimizer state each
rank holds right after ``optimizer.step()`` (an optimizer post-hook counts them, before
unison's step frees the gradients; a DTensor counts its local shard, ``to_local()``).
Each loop is built and stepped on its own for this. Not counted: DDP's gradient buckets,
FSDP2's transient all-gather and reduce-scatter buffers, activations. On CUDA each loop
also reports ``torch.cuda.max_memory_allocated()`` over its steps, above what was
allocated before it was built.

Checkpoints: unison's ``Checkpoint`` (model and optimizer) on a DDP model (one file,
written by rank 0) and on an FSDP model (a folder: every rank writes its shards through
torch's Distributed Checkpoint, rank 0 the rest), each with ``async_save`` off and on.
One trainer per variant runs an epoch per round and saves once, halfway through it; the
first epoch is a warm-up. The stall is ``Checkpoint.stall_seconds`` (how long ``save()``
held rank 0's training loop); "durable" is the time from ``save()`` to the checkpoint
being recorded in the manifest (fsynced and renamed); the size is what is on disk.

    python benchmarks/fsdp.py                 # ~4 minutes on 2 busy CPU cores
    python benchmarks/fsdp.py --quick         # a smoke run, ~1 minute
    python benchmarks/fsdp.py --repeats 21 --json fsdp.json --dir /scratch/ckpt
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

BATCH = 64
ITERS, QUICK_ITERS = 105, 30  # iterations per rank per epoch (105: one unison sync point, at 100)
CKPT_ITERS = 6  # iterations per checkpoint epoch; the save after the 3rd
CKPT_REPEATS, QUICK_CKPT_REPEATS = 7, 2
MEMORY_STEPS = 3
LOOPS = ("raw_ddp", "unison_ddp", "raw_fsdp", "unison_fsdp")
LABELS = {
    "raw_ddp": "raw DDP",
    "unison_ddp": "unison DDP",
    "raw_fsdp": "raw FSDP2",
    "unison_fsdp": "unison FSDP",
}
SAVES = ("ddp_sync", "ddp_async", "fsdp_sync", "fsdp_async")
TARGET = 1.03


# -- inside ranks ---------------------------------------------------------------------------


def local_bytes(tensor: Any) -> int:
    """Bytes of this rank's part of ``tensor``: a DTensor's local shard, any other tensor whole."""
    to_local = getattr(tensor, "to_local", None)
    if callable(to_local):
        tensor = to_local()
    return tensor.numel() * tensor.element_size()


def held_bytes(model: Any, optimizer: Any) -> dict[str, int]:
    """Parameters, gradients and optimizer state this rank holds now, in bytes."""
    import torch

    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    out = {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(local_bytes(v) for v in state),
    }
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def build_loop(name: str, cfg: dict[str, Any], dataset: Any, device: Any) -> dict[str, Any]:
    """One of LOOPS: its model, optimizer, and ``epoch(limit)`` -> (run, clocked)."""
    import torch
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, DistributedSampler

    from unison.distributed import get_world_size, prepare_loaders, prepare_model
    from unison.engine import create_trainer

    amp, world = cfg["amp"], get_world_size()
    if name.startswith("unison"):
        loader, _ = prepare_loaders(dataset, batch_size=BATCH, seed=0)
        strategy: Any = "fsdp" if name.endswith("fsdp") else "ddp"
        model = prepare_model(C.build_mlp(seed=0), strategy=strategy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def unison_epoch(limit: int | None = None) -> Any:
            trainer = create_trainer(model, opt, F.cross_entropy, amp=amp)
            clocked = C.Clocked(loader)  # the engine finds the sampler through it
            return lambda: trainer.run(clocked, max_epochs=1, epoch_length=limit), clocked

        return {"model": model, "optimizer": opt, "epoch": unison_epoch, "iterations": len(loader)}

    model = C.build_mlp(seed=0).to(device)
    if world > 1 and name == "raw_ddp":  # as prepare_model does: no wrapper for a single rank
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    elif world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler: Any = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    epoch = [0]

    def raw_epoch(limit: int | None = None) -> Any:
        clocked = C.Clocked(loader)

        def run() -> None:
            sampler.set_epoch(epoch[0])
            epoch[0] += 1
            model.train()
            for i, (x, y) in enumerate(clocked):
                if limit is not None and i >= limit:
                    break
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                opt.zero_grad(set_to_none=True)
                with C.autocast(device.type, amp):
                    loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()

        return run, clocked

    return {"model": model, "optimizer": opt, "epoch": raw_epoch, "iterations": len(loader)}


def memory_of(name: str, cfg: dict[str, Any], dataset: Any, device: Any) -> dict[str, Any]:
    """Builds one loop alone, runs a few steps, and counts what a rank holds after a step."""
    import gc

    import torch

    cuda = device.type == "cuda"
    gc.collect()  # the loop measured before this one is gone
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    loop = build_loop(name, cfg, dataset, device)
    model, counted = loop["model"], {}

    def count(optimizer: Any, *_: Any) -> None:
        counted.update(held_bytes(model, optimizer))

    hook = loop["optimizer"].register_step_post_hook(count)
    run, _ = loop["epoch"](MEMORY_STEPS)
    run()
    C.synchronize(device)
    hook.remove()
    out: dict[str, Any] = {"bytes": counted}
    if cuda:
        out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device) - before
    return out


def checkpoint_runs(cfg: dict[str, Any], dataset: Any, device: Any) -> dict[str, Any]:
    """Collective: the checkpoint variants, a warm-up epoch then one epoch per round, each saving once."""
    import torch
    from torch.nn import functional as F

    from unison.distributed import get_rank, prepare_loaders, prepare_model
    from unison.engine import Events, create_trainer
    from unison.handlers import Checkpoint

    variants: dict[str, Any] = {}
    for name in SAVES:
        strategy: Any
        strategy, mode = name.split("_")
        loader, _ = prepare_loaders(dataset, batch_size=BATCH, seed=0)
        model = prepare_model(C.build_mlp(seed=0), strategy=strategy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        trainer = create_trainer(model, opt, F.cross_entropy, amp=cfg["amp"])
        checkpoint = Checkpoint(
            Path(cfg["dir"], name),
            {"model": model, "optimizer": opt},
            trainer,
            every_epochs=None,
            at_end=False,  # the end of a run still waits for a write in flight
            keep_last=1,
            async_save=mode == "async",
        )
        checkpoint.attach()
        started: list[float] = []

        def save(engine: Any, checkpoint: Any = checkpoint, started: list[float] = started) -> None:
            if engine.state.iteration % CKPT_ITERS == CKPT_ITERS // 2:
                C.synchronize(device)  # the queued steps finish first: the stall is the save's
                started.append(time.time())
                checkpoint.save(engine)

        trainer.add_event_handler(Events.ITERATION_COMPLETED, save)
        variants[name] = {"trainer": trainer, "checkpoint": checkpoint, "loader": loader, "started": started}

    def one_epoch(name: str, epochs: int) -> dict[str, float]:
        v = variants[name]
        C.barrier(device)
        v["trainer"].run(v["loader"], max_epochs=epochs, epoch_length=CKPT_ITERS)
        if get_rank() != 0:
            return {}
        checkpoint = v["checkpoint"]
        path = checkpoint.saved[-1]
        files = [p for p in path.iterdir() if p.is_file()] if path.is_dir() else [path]
        return {
            "stall_s": checkpoint.stall_seconds[-1],
            "durable_s": checkpoint.manifest.entries[-1].saved_at - v["started"][-1],
            "bytes": sum(p.stat().st_size for p in files),
            "files": len(files),
        }

    for name in SAVES:  # warm-up: the first save makes the async group, loads DCP's modules
        one_epoch(name, 1)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in SAVES}
    for r in range(cfg["ckpt_repeats"]):
        for name in C.rotated(list(SAVES), r):
            runs[name].append(one_epoch(name, r + 2))
    for v in variants.values():
        v["checkpoint"].wait()
    return runs


def worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """Runs on every rank: memory, then the four loops interleaved, then the checkpoints."""
    import torch

    from unison.distributed import device as rank_device
    from unison.distributed import get_world_size

    device = rank_device()
    if device.type == "cpu":
        torch.set_num_threads(cfg["threads"])
    dataset = C.classification_data(cfg["iters"] * BATCH * get_world_size())

    if device.type == "cuda":  # the first steps on a GPU allocate cuBLAS's workspace: not the loop's
        memory_of(LOOPS[0], cfg, dataset, device)
    memory = {name: memory_of(name, cfg, dataset, device) for name in LOOPS}

    loops = {name: build_loop(name, cfg, dataset, device) for name in LOOPS}

    def timed(name: str, limit: int | None = None) -> list[float]:
        run, clocked = loops[name]["epoch"](limit)
        wall, cpu = C.timed_block(run, device)
        return [wall, cpu, *C.slowest([clocked.median_interval()], device)]

    for name in LOOPS:  # warm-up: allocator, DDP's bucket rebuild, FSDP2's lazy init, caches
        timed(name, limit=10)
    times: dict[str, list[list[float]]] = {name: [] for name in LOOPS}
    for r in range(cfg["repeats"]):
        for name in C.rotated(list(LOOPS), r):
            times[name].append(timed(name))
    iterations = {name: loop["iterations"] for name, loop in loops.items()}
    loops.clear()

    checkpoints = checkpoint_runs(cfg, dataset, device)
    return {"iterations": iterations, "times": times, "memory": memory, "checkpoints": checkpoints}


# -- the report -----------------------------------------------------------------------------


def summarise_times(out: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    n = out["iterations"]["raw_ddp"]
    assert set(out["iterations"].values()) == {n}, out["iterations"]
    wall = {v: [t[0] for t in ts] for v, ts in out["times"].items()}
    cpu = {v: [t[1] for t in ts] for v, ts in out["times"].items()}
    it = {v: [t[2] for t in ts] for v, ts in out["times"].items()}
    rows = {
        v: {
            "median_epoch_s": C.median(wall[v]),
            "iterations_per_second": n / C.median(wall[v]),
            "median_iteration_ms": C.median(it[v]) * 1e3,
            "iteration_ratio_to_raw_ddp": C.paired_ratio(it[v], it["raw_ddp"]),
            "iteration_spread": C.spread(it[v]),
            "epoch_ratio_to_raw_ddp": C.paired_ratio(wall[v], wall["raw_ddp"]),
            "cpu_median_epoch_s": C.median(cpu[v]),
            "epoch_s": wall[v],
            "median_iteration_s_each_epoch": it[v],
        }
        for v in wall
    }
    pairs = {
        "unison FSDP / raw FSDP2": ("unison_fsdp", "raw_fsdp"),
        "unison DDP / raw DDP": ("unison_ddp", "raw_ddp"),
        "raw FSDP2 / raw DDP": ("raw_fsdp", "raw_ddp"),
        "unison FSDP / unison DDP": ("unison_fsdp", "unison_ddp"),
    }
    ratios = {
        label: {
            "iteration": C.paired_ratio(it[a], it[b]),
            "iteration_ci95": list(C.ratio_ci(it[a], it[b])),
            "epoch": C.paired_ratio(wall[a], wall[b]),
            "epoch_ci95": list(C.ratio_ci(wall[a], wall[b])),
        }
        for label, (a, b) in pairs.items()
    }
    return {"iterations_per_epoch": n, "repeats": cfg["repeats"], "results": rows, "ratios": ratios}


def summarise_checkpoints(runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    stall = {v: [r["stall_s"] for r in rs] for v, rs in runs.items()}
    return {
        v: {
            "stall_ms_median": C.median(stall[v]) * 1e3,
            "stall_ratio_to_ddp_sync": C.paired_ratio(stall[v], stall["ddp_sync"]),
            "stall_ratio_to_sync": C.paired_ratio(stall[v], stall[v.split("_")[0] + "_sync"]),
            "durable_ms_median": C.median(r["durable_s"] for r in rs) * 1e3,
            "bytes": rs[-1]["bytes"],
            "files": rs[-1]["files"],
            "runs": rs,
        }
        for v, rs in runs.items()
    }


def mb(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_common_args(parser, repeats=9, quick_repeats=2)
    parser.add_argument(
        "--nproc", type=int, default=None, help="ranks; default 2 on the CPU, every GPU on CUDA"
    )
    parser.add_argument(
        "--dir", type=Path, default=None, help="where checkpoints are written (default: a temp folder)"
    )
    args = parser.parse_args(argv)
    repeats = C.resolve_repeats(args)
    import torch

    from unison.distributed import launch

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
    cfg: dict[str, Any] = {
        "nproc": nproc,
        "backend": "nccl" if device == "cuda" else "gloo",
        "threads": C.rank_threads(nproc),
        "amp": amp,
        "iters": QUICK_ITERS if args.quick else ITERS,
        "repeats": repeats,
        "ckpt_repeats": QUICK_CKPT_REPEATS if args.quick else CKPT_REPEATS,
    }
    report: dict[str, Any] = {
        "benchmark": "fsdp",
        **C.environment(device),
        "quick": args.quick,
        "config": cfg,
    }
    C.print_environment(report)
    if nproc < 2:
        print("one rank: nothing is wrapped or sharded (NCCL needs one GPU per rank); FSDP is DDP here")

    with tempfile.TemporaryDirectory(prefix="unison-bench-fsdp-", dir=args.dir) as folder:
        cfg["dir"] = folder
        out = launch(worker, cfg, nproc_per_node=nproc, backend=cfg["backend"], start_method="spawn")[0]
        del cfg["dir"]

    times = summarise_times(out, cfg)
    report["throughput"] = times
    rows = times["results"]
    C.print_table(
        f"training: {nproc} {cfg['backend']} ranks, MLP, AdamW, batch {BATCH}/rank, "
        f"{times['iterations_per_epoch']} iterations/epoch, {repeats} interleaved epochs each "
        "(medians, slowest rank; x raw DDP: median of paired ratios)",
        ["loop", "it/s per rank", "epoch s", "x raw DDP", "median it ms", "x raw DDP", "spread"],
        [
            [
                LABELS[v],
                f"{r['iterations_per_second']:.1f}",
                f"{r['median_epoch_s']:.3f}",
                f"{r['epoch_ratio_to_raw_ddp']:.3f}",
                f"{r['median_iteration_ms']:.2f}",
                f"{r['iteration_ratio_to_raw_ddp']:.3f}",
                f"{r['iteration_spread']:.2f}",
            ]
            for v, r in rows.items()
        ],
    )
    C.print_table(
        "ratios (median of paired ratios over rounds, bootstrap 95% interval)",
        ["ratio", "median iteration", "95% CI", "epoch", "95% CI"],
        [
            [
                label,
                f"{x['iteration']:.3f}",
                f"{x['iteration_ci95'][0]:.3f}-{x['iteration_ci95'][1]:.3f}",
                f"{x['epoch']:.3f}",
                f"{x['epoch_ci95'][0]:.3f}-{x['epoch_ci95'][1]:.3f}",
            ]
            for label, x in times["ratios"].items()
        ],
    )

    memory = out["memory"]
    ddp_total = memory["raw_ddp"]["bytes"]["total"]
    report["memory"] = {
        v: {**m, "ratio_to_raw_ddp": m["bytes"]["total"] / ddp_total} for v, m in memory.items()
    }
    cuda_peak = all("cuda_peak_bytes" in m for m in memory.values())
    C.print_table(
        f"memory per rank right after optimizer.step(), MiB (counted: local shards of DTensors; "
        f"{MEMORY_STEPS} steps, each loop built alone)",
        ["loop", "params", "grads", "AdamW state", "total", "x DDP"] + (["cuda peak"] if cuda_peak else []),
        [
            [
                LABELS[v],
                mb(m["bytes"]["params"]),
                mb(m["bytes"]["grads"]),
                mb(m["bytes"]["optimizer"]),
                mb(m["bytes"]["total"]),
                f"{m['ratio_to_raw_ddp']:.4f}",
            ]
            + ([mb(m["cuda_peak_bytes"])] if cuda_peak else [])
            for v, m in report["memory"].items()
        ],
    )

    saves = summarise_checkpoints(out["checkpoints"])
    report["checkpoints"] = {
        "iterations_per_run": CKPT_ITERS,
        "repeats": cfg["ckpt_repeats"],
        "results": saves,
    }
    C.print_table(
        f"checkpoint of model + AdamW: {cfg['ckpt_repeats']} interleaved saves each after a warm-up "
        "(medians; stall: Checkpoint.stall_seconds on rank 0)",
        ["save", "stall ms", "x DDP sync", "x sync", "durable ms", "on disk MiB", "files"],
        [
            [
                v.replace("_", " "),
                f"{s['stall_ms_median']:.1f}",
                f"{s['stall_ratio_to_ddp_sync']:.3f}",
                f"{s['stall_ratio_to_sync']:.3f}",
                f"{s['durable_ms_median']:.1f}",
                mb(s["bytes"]),
                str(s["files"]),
            ]
            for v, s in saves.items()
        ],
    )

    fsdp_ratio = times["ratios"]["unison FSDP / raw FSDP2"]
    targets = [
        C.judge(
            "unison FSDP within 3% of a raw FSDP2 loop (median iteration)",
            fsdp_ratio["iteration"],
            TARGET,
            tuple(fsdp_ratio["iteration_ci95"]),
            epoch_time_ratio=round(fsdp_ratio["epoch"], 3),
        )
    ]
    if nproc > 1:
        share = report["memory"]["unison_fsdp"]["ratio_to_raw_ddp"]
        targets.append(
            C.judge(
                f"unison FSDP holds at most 1/{nproc} of DDP's parameters + gradients + optimizer state "
                "per rank (+1%)",
                share,
                round(1.01 / nproc, 4),
            )
        )
    report["targets"] = targets
    C.print_targets(targets)
    C.write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
