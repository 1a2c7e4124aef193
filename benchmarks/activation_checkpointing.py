"""Activation checkpointing on and off: peak memory of a training step and time per iteration.

Single process, one thread. The charlm recipe's causal Transformer
(``recipes/charlm/charlm.py``: ``CharTransformer``, pre-norm ``TransformerEncoderLayer``
blocks, dropout 0.1), AdamW, cross-entropy, batches already on the device, two variants:

    plain         ``prepare_model(model)``
    checkpointed  ``prepare_model(model, activation_checkpointing="auto")`` (the encoder
                  layers recompute their activations in backward)

Memory is measured in a fresh process per variant and repeat, so no variant inherits the
other's allocator state. On the CPU: the growth of the process's peak resident set
(``ru_maxrss``) over the timed steps, above its peak after one step with a batch of one
(which allocated the gradients and AdamW's state, so what remains is the step's
activations and temporaries); torch keeps no peak of CPU allocations itself. On CUDA:
``torch.cuda.max_memory_allocated`` during the steps minus the memory allocated before
them (a larger model there: ``CUDA_SHAPE``; bf16 autocast by default, ``--amp``). Time: both variants in one process, interleaved in an order rotated every round;
the median iteration per variant and the median of paired ratios.

    python benchmarks/activation_checkpointing.py            # ~2-3 minutes on 2 busy cores
    python benchmarks/activation_checkpointing.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "recipes" / "charlm"))

import _common as C  # noqa: E402

VARIANTS = ["plain", "checkpointed"]
SHAPE = {"block": 128, "dim": 128, "heads": 4, "layers": 4, "dropout": 0.1}
CUDA_SHAPE = {"block": 512, "dim": 512, "heads": 8, "layers": 8, "dropout": 0.1}
"""On a GPU the model is larger: the small one's step is too short to time, its activations too small."""
BATCH = 32
ITERATIONS, QUICK_ITERATIONS = 8, 3


def shape(device: Any) -> dict[str, Any]:
    import torch

    return CUDA_SHAPE if torch.device(device).type == "cuda" else SHAPE


def build(variant: str, device: Any) -> tuple[Any, Any]:
    import charlm
    import torch

    from unison.distributed import prepare_model

    torch.manual_seed(0)
    ac = "auto" if variant == "checkpointed" else False
    model = prepare_model(charlm.CharTransformer(**shape(device)), device=device, activation_checkpointing=ac)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def make_data(n: int, batch: int, device: Any) -> list[Any]:
    import torch

    gen = torch.Generator().manual_seed(0)
    return [
        (
            torch.randint(0, 90, (batch, shape(device)["block"]), generator=gen).to(device),
            torch.randint(0, 90, (batch, shape(device)["block"]), generator=gen).to(device),
        )
        for _ in range(n)
    ]


def step(model: Any, optimizer: Any, x: Any, y: Any, amp: str | None = None) -> None:
    import torch

    optimizer.zero_grad(set_to_none=False)
    with C.autocast(x.device.type, amp):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()


def peak_memory(variant: str, device_name: str, n: int, amp: str | None) -> dict[str, float]:
    """In this (fresh) process: the peak memory the training steps add, in MiB."""
    import torch

    torch.set_num_threads(1)
    device = torch.device(device_name)
    model, optimizer = build(variant, device)
    data = make_data(n, BATCH, device)
    step(model, optimizer, *make_data(1, 1, device)[0], amp)  # gradients and AdamW's state, tiny activations
    C.synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for x, y in data:
        step(model, optimizer, x, y, amp)
    C.synchronize(device)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"step_peak_mib": (peak - before) / 2**20}


def measure_memory(repeats: int, device: str, n: int, amp: str | None) -> dict[str, Any]:
    each: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(repeats):
        for variant in C.rotated(VARIANTS, r):
            cmd = [sys.executable, __file__, "--_memory", variant, "--device", device, "--_n", str(n)]
            cmd += ["--amp", amp or "none"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
            each[variant].append(json.loads(done.stdout.strip().splitlines()[-1])["step_peak_mib"])
    return {v: {"median_mib": C.median(each[v]), "each_mib": each[v]} for v in VARIANTS}


def measure_time(repeats: int, device: Any, n: int, amp: str | None) -> dict[str, Any]:
    built = {v: build(v, device) for v in VARIANTS}
    data = make_data(n, BATCH, device)
    for model, optimizer in built.values():  # warm-up
        step(model, optimizer, *data[0], amp)
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(repeats):
        for variant in C.rotated(VARIANTS, r):
            model, optimizer = built[variant]
            times = []
            for x, y in data:
                C.synchronize(device)
                start = time.perf_counter()
                step(model, optimizer, x, y, amp)
                C.synchronize(device)
                times.append(time.perf_counter() - start)
            seconds[variant].append(C.median(times))
    return {
        v: {
            "median_ms": C.median(seconds[v]) * 1e3,
            "x_plain": C.paired_ratio(seconds[v], seconds["plain"]),
            "spread": C.spread(seconds[v]),
            "each_ms": [s * 1e3 for s in seconds[v]],
        }
        for v in VARIANTS
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_common_args(parser, repeats=5, quick_repeats=2)
    parser.add_argument("--_memory", dest="memory", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_n", dest="n", type=int, default=ITERATIONS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device_name = C.resolve_device(args.device)
    if args.memory:  # a child of measure_memory
        amp = None if args.amp in (None, "none") else args.amp
        print(json.dumps(peak_memory(args.memory, device_name, args.n, amp)))
        return 0
    repeats = C.resolve_repeats(args)
    n = QUICK_ITERATIONS if args.quick else ITERATIONS

    import torch

    torch.set_num_threads(1)
    device = torch.device(device_name)
    amp = C.resolve_amp(args.amp, device.type)
    report: dict[str, Any] = {
        "benchmark": "activation_checkpointing",
        **C.environment(device),
        "quick": args.quick,
        "amp": amp,
    }
    report["model"] = {**shape(device), "batch": BATCH, "iterations": n}
    C.print_environment(report)
    report["memory"] = memory = measure_memory(repeats, device_name, n, amp)
    report["time"] = timing = measure_time(repeats, device, n, amp)
    what = "peak RSS growth" if device.type == "cpu" else "max_memory_allocated growth"
    C.print_table(
        f"charlm CharTransformer {shape(device)}, batch {BATCH}, amp {amp}: {n} iterations x {repeats} repeats (medians)",
        ["variant", f"step memory MiB ({what})", "x plain", "iteration ms", "x plain", "spread"],
        [
            [
                v,
                f"{memory[v]['median_mib']:.1f}",
                f"{memory[v]['median_mib'] / memory['plain']['median_mib']:.2f}",
                f"{timing[v]['median_ms']:.1f}",
                f"{timing[v]['x_plain']:.3f}",
                f"{timing[v]['spread']:.2f}",
            ]
            for v in VARIANTS
        ],
    )
    C.write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
