"""Helpers shared by the benchmark scripts: environment, devices, statistics, tables, JSON.

Nothing here imports torch, ignite or unison at module level: ``ddp.py`` times its own
imports in fresh processes, and must decide itself what a worker imports.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

MLP_SIZES = (784, 512, 512, 10)
"""The MLP every benchmark trains: 784-512-512-10, ReLU (about 670k parameters)."""


# -- environment ----------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU's model name (Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: Any = None) -> dict[str, Any]:
    """Date, machine, versions and load: the header every report starts with."""
    import ignite
    import torch

    import unison

    env: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": f"{platform.machine()}, {cpu_model()}, {os.cpu_count()} logical CPUs",
        "os": platform.platform(terse=True),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "ignite": ignite.__version__,
        "unison": unison.__version__,
        "device": str(device) if device is not None else None,
        "torch_threads": torch.get_num_threads(),
    }
    try:
        env["load_average_1_5_15min"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["cuda"] = torch.version.cuda
    return env


def print_environment(env: Mapping[str, Any]) -> None:
    # gpus and cuda are there only where torch sees a GPU (the CPU line is unchanged)
    keys = (
        "date",
        "machine",
        "python",
        "torch",
        "ignite",
        "unison",
        "device",
        "gpus",
        "cuda",
        "load_average_1_5_15min",
    )
    print("  ".join(f"{k}={env[k]}" for k in keys if k in env and env[k] is not None))


# -- devices --------------------------------------------------------------------------


def add_common_args(parser: Any, *, repeats: int, quick_repeats: int) -> None:
    """``--device``, ``--amp``, ``--repeats``, ``--quick`` and ``--json``, the same everywhere."""
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="where to compute; default cuda when available, else cpu",
    )
    parser.add_argument(
        "--amp",
        choices=["none", "bf16"],
        default=None,
        help="autocast dtype; default bf16 on CUDA (when supported), none on the CPU",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"interleaved repeats (default {repeats}; {quick_repeats} with --quick)",
    )
    parser.add_argument("--quick", action="store_true", help="a short run: fewer repeats, fewer iterations")
    parser.add_argument("--json", type=Path, default=None, help="write the report here, as JSON")
    parser.set_defaults(_default_repeats=(repeats, quick_repeats))


def resolve_repeats(args: Any) -> int:
    full, quick = args._default_repeats
    repeats = args.repeats if args.repeats is not None else (quick if args.quick else full)
    if repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {repeats}")
    return repeats


def resolve_device(name: str | None) -> str:
    """``"cuda"`` or ``"cpu"``; the default is cuda when available."""
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for, but torch.cuda.is_available() is False here.")
    return name


def resolve_amp(amp: str | None, device_type: str) -> str | None:
    """``"bf16"`` or None. Default: bf16 on a GPU that supports it, full precision on the CPU."""
    import torch

    if amp is None:
        return "bf16" if device_type == "cuda" and torch.cuda.is_bf16_supported() else None
    return None if amp == "none" else amp


def autocast(device_type: str, amp: str | None) -> Any:
    """The autocast context a raw loop uses for ``amp`` (a null context without)."""
    import contextlib

    import torch

    if amp is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.bfloat16)


def synchronize(device: Any) -> None:
    """Waits for the device's queued work (a no-op on the CPU): call before reading a clock."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def rank_threads(nproc: int) -> int:
    """torch threads per rank when ``nproc`` ranks share this machine's CPUs."""
    return max(1, (os.cpu_count() or 1) // nproc)


def build_mlp(seed: int = 0) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    a, b, c, d = MLP_SIZES
    return nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, c), nn.ReLU(), nn.Linear(c, d))


def classification_data(n: int, seed: int = 0) -> Any:
    """A TensorDataset of ``n`` random MNIST-shaped samples (784 features, 10 classes)."""
    import torch
    from torch.utils.data import TensorDataset

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, MLP_SIZES[0], generator=gen)
    y = torch.randint(0, MLP_SIZES[-1], (n,), generator=gen)
    return TensorDataset(x, y)


class Clocked:
    """Iterates over ``data``, reading the clock as each batch is handed out.

    Every variant of a benchmark, the raw loop included, draws its batches through one,
    so the stamping costs all alike (a clock read and an append per batch). Two
    consecutive stamps bracket one whole iteration: the step and all an engine does around
    it. The median interval is a per-iteration time that a burst of load from another job
    moves little; it leaves out what happens once in many iterations (sync points). Other
    attributes (``sampler``, ``batch_sampler``) are the wrapped loader's, so an engine still
    finds the sampler to call ``set_epoch`` on.
    """

    def __init__(self, data: Any) -> None:
        self.data = data
        self.stamps: list[float] = []

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self) -> Any:
        stamps, clock = self.stamps, time.perf_counter
        for batch in self.data:
            stamps.append(clock())
            yield batch

    def __getattr__(self, name: str) -> Any:
        if name == "data":  # not set yet: do not recurse
            raise AttributeError(name)
        return getattr(self.data, name)

    def median_interval(self) -> float:
        s = self.stamps
        return statistics.median(b - a for a, b in zip(s, s[1:], strict=False))


# -- inside ranks ---------------------------------------------------------------------


def comm_device(device: Any) -> Any:
    """Where the backend's collectives want tensors: the GPU for NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    return torch.device(device) if dist.get_backend() == "nccl" else torch.device("cpu")


def barrier(device: Any) -> None:
    """Collective: waits for the device's work and for every rank (an all-reduce, not
    ``dist.barrier``, which on NCCL guesses a device)."""
    import torch
    import torch.distributed as dist

    synchronize(device)
    dist.all_reduce(torch.zeros(1, device=comm_device(device)))


def slowest(values: Sequence[float], device: Any) -> list[float]:
    """Collective: the maximum of each value over all ranks."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.float64, device=comm_device(device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def timed_block(run: Any, device: Any) -> list[float]:
    """Collective: [wall, cpu] seconds of ``run()`` on the slowest rank, started together."""
    barrier(device)
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    synchronize(device)
    return slowest([time.perf_counter() - wall, time.process_time() - cpu], device)


# -- statistics -----------------------------------------------------------------------


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def paired_ratio(values: Sequence[float], base: Sequence[float]) -> float:
    """Median over repeats of ``values[i] / base[i]``.

    Repeats interleave, so the i-th value and the i-th base ran side by side and saw the
    same load; the ratio of each pair cancels most of a shared machine's drift.
    """
    return statistics.median(v / b for v, b in zip(values, base, strict=True))


def ratio_ci(values: Sequence[float], base: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """A bootstrap confidence interval of :func:`paired_ratio` (2000 resamples, seeded).

    On a shared machine a target a few percent away cannot always be told from noise;
    the interval says whether it can.
    """
    import random

    ratios = [v / b for v, b in zip(values, base, strict=True)]
    rng = random.Random(0)
    n = 2000
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(n))
    return medians[int((1 - level) / 2 * n)], medians[int((1 + level) / 2 * n) - 1]


def judge(
    target: str, value: float, limit: float, ci: tuple[float, float] | None = None, **details: Any
) -> dict:
    """A target ``value <= limit``: met or not, and whether the noise lets one tell."""
    met = value <= limit
    out: dict[str, Any] = {"target": target, "value": round(value, 4), "limit": limit, **details, "met": met}
    if ci is not None:
        out["ci95"] = [round(ci[0], 4), round(ci[1], 4)]
        out["conclusive"] = ci[1] <= limit if met else ci[0] > limit
    return out


def print_targets(targets: Sequence[Mapping[str, Any]]) -> None:
    print()
    for t in targets:
        details = ", ".join(
            f"{k}={v}"
            for k, v in t.items()
            if k not in ("target", "met", "conclusive", "ci95", "value", "limit")
        )
        head = f"target {verdict(t['met'])}: {t['target']}"
        if "value" in t:
            head += f": {t['value']:g} (limit {t['limit']:g}"
            if "ci95" in t:
                head += f", 95% CI {t['ci95'][0]:.3f}-{t['ci95'][1]:.3f}"
            head += ")"
        if t.get("conclusive") is False:
            head += " -- within noise"
        print(head + (f" [{details}]" if details else ""))


def spread(values: Sequence[float]) -> float:
    """Interquartile range over median: how noisy the repeats were (0.1 = +-5%)."""
    if len(values) < 4:
        return (max(values) - min(values)) / statistics.median(values)
    q = statistics.quantiles(values, n=4)
    return (q[2] - q[0]) / statistics.median(values)


def rotated(items: Sequence[Any], round_index: int) -> list[Any]:
    """``items`` rotated by ``round_index``, so no variant always runs first (or last)."""
    k = round_index % len(items)
    return list(items[k:]) + list(items[:k])


# -- output ---------------------------------------------------------------------------


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain-text table; numbers are expected pre-formatted as strings."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for i, row in enumerate(cells):
        print(
            "  ".join(
                c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if i == 0:
            print("  ".join("-" * w for w in widths))


def write_json(path: Path | None, report: Mapping[str, Any]) -> None:
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {path}")


def verdict(met: bool | None) -> str:
    """How a target is printed; None when the run cannot judge it (one rank, say)."""
    if met is None:
        return "n/a"
    return "met" if met else "MISSED"
