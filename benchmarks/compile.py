"""torch.compile on and off: the per-iteration time of a raw loop and of unison, and the compile cost.

Single process, one thread. The MLP workload of ``overhead.py`` (784-512-512-10, batch 64,
cross-entropy, SGD; batches already on the device), four variants side by side:

    raw             a hand-written loop (zero_grad, forward, loss, backward, step)
    raw+compile     the same loop over ``torch.compile(model)``
    unison          ``prepare_model`` + ``create_trainer`` (sync_every=100, the default)
    unison+compile  the same with ``prepare_model(model, compile=True)`` (compiled in
                    place; on the CPU with inductor's peak-memory reordering off, see
                    unison/distributed/compile.py)

Each variant's model is built and compiled once, before the clock (a warm-up run compiles
it); the timed runs interleave in an order rotated every round, so a shared machine's
load hits all variants alike, and the report says how many graphs were compiled while the
clock ran (0: the timings hold no compilation). Per variant: the median over repeats of
the median iteration (the clock is read as each batch is drawn, by every variant alike)
and of CPU time per iteration over whole runs; ratios are medians over rounds of the
ratio to the run of the same round ("x raw": to the raw eager loop; "x eager": a compiled
variant to its own eager one; "x raw+compile": unison compiled to the raw compiled loop).

The one-time compile cost is the first iteration of a compiled variant minus its median
iteration, each in a fresh process: "cold" with an empty inductor cache (a first run on a
machine), "warm" again in a new process over the cache the cold run filled (a second job,
or a restart: dynamo traces again, inductor's compiled kernels are found on disk).

    python benchmarks/compile.py                  # ~3-5 minutes on 2 busy cores
    python benchmarks/compile.py --quick          # a smoke run
    python benchmarks/compile.py --device cuda    # on a GPU (bf16 autocast by default)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

VARIANTS = ["raw", "raw+compile", "unison", "unison+compile"]
ITERATIONS, QUICK_ITERATIONS = 60, 12
BATCH = 64


def make_data(n: int, device: Any) -> list[Any]:
    import torch

    gen = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(BATCH, C.MLP_SIZES[0], generator=gen).to(device),
            torch.randint(0, C.MLP_SIZES[-1], (BATCH,), generator=gen).to(device),
        )
        for _ in range(n)
    ]


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class Variant:
    """One variant's model, optimizer and step, built once; ``runner(data)`` trains over ``data``."""

    def __init__(self, name: str, device: Any, amp: str | None) -> None:
        import torch
        from torch import nn

        self.name = name
        compile = name.endswith("+compile")
        if name.startswith("unison"):
            from unison.distributed import prepare_model
            from unison.engine import create_trainer

            self.model = prepare_model(C.build_mlp(seed=0), device=device, compile=compile)
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
            self.trainer = create_trainer(self.model, self.optimizer, nn.functional.cross_entropy, amp=amp)
            return
        self.model = C.build_mlp(seed=0).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.call = torch.compile(self.model) if compile else self.model
        self.device, self.amp = device, amp

    def runner(self, data: Any) -> Callable[[], Any]:
        if self.name.startswith("unison"):
            return lambda: self.trainer.run(data, max_epochs=1)
        from torch import nn

        model, call, opt, device, amp = self.model, self.call, self.optimizer, self.device, self.amp
        device_type = next(model.parameters()).device.type

        def run_raw() -> None:
            model.train()
            for x, y in data:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                opt.zero_grad(set_to_none=True)
                with C.autocast(device_type, amp):
                    loss = nn.functional.cross_entropy(call(x), y)
                loss.backward()
                opt.step()

        return run_raw


def timed(run: Callable[[], Any], device: Any) -> tuple[float, float]:
    C.synchronize(device)
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    C.synchronize(device)
    return time.perf_counter() - wall, time.process_time() - cpu


def measure_iterations(repeats: int, quick: bool, device: Any, amp: str | None) -> dict[str, Any]:
    n = QUICK_ITERATIONS if quick else ITERATIONS
    data = make_data(n, device)
    variants = {name: Variant(name, device, amp) for name in VARIANTS}
    for variant in variants.values():  # warm-up: compiles the compiled ones
        timed(variant.runner(data[:3]), device)
    graphs_before = graphs_compiled()
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    iteration: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(repeats):
        for name in C.rotated(VARIANTS, r):
            clocked = C.Clocked(data)
            _, c = timed(variants[name].runner(clocked), device)
            cpu[name].append(c / n)
            iteration[name].append(clocked.median_interval())
    rows: dict[str, Any] = {}
    for v in VARIANTS:
        eager = v.replace("+compile", "")
        row: dict[str, Any] = {}
        for key, values in (("iteration_", iteration), ("cpu_", cpu)):
            row[f"{key}median_us"] = C.median(values[v]) * 1e6
            row[f"{key}x_raw"] = C.paired_ratio(values[v], values["raw"])
            row[f"{key}x_eager"] = C.paired_ratio(values[v], values[eager]) if v != eager else None
            row[f"{key}spread"] = C.spread(values[v])
            row[f"{key}us_each_repeat"] = [x * 1e6 for x in values[v]]
        if v == "unison+compile":
            row["iteration_x_raw_compile"] = C.paired_ratio(iteration[v], iteration["raw+compile"])
            row["iteration_x_raw_compile_ci95"] = list(C.ratio_ci(iteration[v], iteration["raw+compile"]))
        rows[v] = row
    return {
        "iterations": n,
        "repeats": repeats,
        "graphs_compiled_while_timed": graphs_compiled() - graphs_before,
        "results": rows,
    }


# -- the one-time cost, in fresh processes -------------------------------------------------------


def first_iteration(name: str, device: str, amp: str | None) -> dict[str, float]:
    """In this (fresh) process: the first iteration of ``name`` and the median of the next ones."""
    import torch

    torch.set_num_threads(1)
    data = make_data(12, device)
    variant = Variant(name, device, amp)
    first = timed(variant.runner(data[:1]), device)[0]
    clocked = C.Clocked(data[1:])
    timed(variant.runner(clocked), device)
    return {"first_s": first, "median_s": clocked.median_interval(), "graphs": graphs_compiled()}


def compile_cost(repeats: int, device: str, amp: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("raw+compile", "unison+compile"):
        cold, warm = [], []
        for _ in range(repeats):
            with tempfile.TemporaryDirectory(prefix="unison-inductor-") as cache:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
                for kind in (cold, warm):
                    cmd = [sys.executable, __file__, "--_first-iteration", name, "--device", device]
                    cmd += ["--amp", amp or "none"]
                    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
                    if done.returncode != 0:
                        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
                    result = json.loads(done.stdout.strip().splitlines()[-1])
                    kind.append(result["first_s"] - result["median_s"])
        out[name] = {"cold_s": C.median(cold), "warm_s": C.median(warm), "cold_each": cold, "warm_each": warm}
    return out


def targets(iterations: dict[str, Any]) -> list[dict]:
    row = iterations["results"]["unison+compile"]
    return [
        C.judge(
            "unison compiled within 2% of the raw compiled loop (median iteration, x raw+compile)",
            row["iteration_x_raw_compile"],
            1.02,
            tuple(row["iteration_x_raw_compile_ci95"]),
        )
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_common_args(parser, repeats=15, quick_repeats=3)
    parser.add_argument(
        "--cost-repeats",
        type=int,
        default=None,
        help="fresh-process compile measurements (2; 1 with --quick)",
    )
    parser.add_argument("--_first-iteration", dest="first_iteration", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device_name = C.resolve_device(args.device)
    if args.first_iteration:  # a child of compile_cost
        amp = None if args.amp in (None, "none") else args.amp
        print(json.dumps(first_iteration(args.first_iteration, device_name, amp)))
        return 0
    repeats = C.resolve_repeats(args)
    cost_repeats = args.cost_repeats if args.cost_repeats is not None else (1 if args.quick else 2)

    import torch

    torch.set_num_threads(1)
    device = torch.device(device_name)
    amp = C.resolve_amp(args.amp, device.type)
    report: dict[str, Any] = {
        "benchmark": "compile",
        **C.environment(device),
        "amp": amp,
        "quick": args.quick,
    }
    C.print_environment(report)
    report["per_iteration"] = it = measure_iterations(repeats, args.quick, device, amp)
    C.print_table(
        f"MLP 784-512-512-10, batch {BATCH}: {it['iterations']} iterations x {it['repeats']} repeats "
        f"(medians; ratios: medians of paired ratios); graphs compiled while timed: "
        f"{it['graphs_compiled_while_timed']}",
        ["variant", "median it us", "x raw", "x eager", "cpu us/it", "x raw", "x eager", "spread"],
        [
            [
                v,
                f"{r['iteration_median_us']:.1f}",
                f"{r['iteration_x_raw']:.3f}",
                "" if r["iteration_x_eager"] is None else f"{r['iteration_x_eager']:.3f}",
                f"{r['cpu_median_us']:.1f}",
                f"{r['cpu_x_raw']:.3f}",
                "" if r["cpu_x_eager"] is None else f"{r['cpu_x_eager']:.3f}",
                f"{r['iteration_spread']:.2f}",
            ]
            for v, r in it["results"].items()
        ],
    )
    report["compile_cost"] = cost = compile_cost(cost_repeats, device_name, amp)
    C.print_table(
        f"one-time compile cost, s (first iteration minus the median one; fresh processes, {cost_repeats} each)",
        ["variant", "cold cache", "warm cache"],
        [[v, f"{c['cold_s']:.1f}", f"{c['warm_s']:.1f}"] for v, c in cost.items()],
    )
    report["targets"] = targets(it)
    C.print_targets(report["targets"])
    C.write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
