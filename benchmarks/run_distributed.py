"""What a ``unison.testing.run_distributed`` call costs, against starting 2 raw gloo ranks.

Three ways to run a function (a no-op) on 2 gloo ranks on this machine, each in a process
group of its own:

    raw     torch.multiprocessing.spawn of 2 processes that init a gloo group and destroy it
            (what any test of distributed code pays without help: each rank imports torch);
            returns once both exited
    cold    run_distributed(fn, fresh=True): ranks spawned anew through launch (a fork server
            that imported torch once; the first call starts it); returns once both exited
    warm    run_distributed(fn): ranks forked by the pool's warm process ahead of the call, in a
            group they formed ahead (the first call starts the warm process); returns once both
            functions returned, the ranks leave their group and exit after it

The first cold and the first warm call (each starting its server) are reported on their own;
then rounds interleave one raw start, one cold call, ``--warm-calls`` warm calls back to back
(each call then also waits for the forming of the group its ranks formed while the previous
call's ranks left: the work moved off a call is still paid, by the next) and as many spaced
``--space-s`` apart (as in a test suite, where a test does other work between its calls: the
latency a call adds). Medians over the rounds; the ratios are medians of the per-round ratios
to that round's raw start. Target: a warm call, back to back, <= 0.02 x a raw start.

    python benchmarks/run_distributed.py            # ~2 min on 2 busy CPU cores
    python benchmarks/run_distributed.py --quick    # ~1 min
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

TARGET = 0.02


def raw_rank(rank: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    dist.destroy_process_group()


def noop() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def raw_start() -> float:
    import torch.multiprocessing as mp

    from unison.distributed.env import find_free_port

    start = time.perf_counter()
    mp.spawn(raw_rank, args=(find_free_port("127.0.0.1"),), nprocs=2)
    return time.perf_counter() - start


def call(fresh: bool) -> float:
    from unison.testing import run_distributed

    start = time.perf_counter()
    assert run_distributed(noop, nproc=2, timeout=120, fresh=fresh) == [0, 1]
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=None, help="rounds (default 5; 2 with --quick)")
    parser.add_argument("--warm-calls", type=int, default=10, help="warm calls per round (default 10)")
    parser.add_argument(
        "--space-s", type=float, default=0.5, help="pause before each spaced warm call (default 0.5)"
    )
    parser.add_argument("--quick", action="store_true", help="a short run: fewer rounds")
    parser.add_argument("--json", type=Path, default=None, help="write the report here, as JSON")
    args = parser.parse_args(argv)
    rounds = args.repeats if args.repeats is not None else (2 if args.quick else 5)
    env = C.environment()
    C.print_environment(env)
    # The ranks import the function by name, and the pool leaves a function of __main__ (a
    # script) to launch: the calls use this file imported as a module.
    module = importlib.import_module("run_distributed")
    first_cold = module.call(True)
    first_warm = module.call(False)
    raw, cold, warm, spaced, cold_ratio, warm_ratio, spaced_ratio = [], [], [], [], [], [], []
    for _ in range(rounds):
        r = module.raw_start()
        c = module.call(True)
        w = C.median([module.call(False) for _ in range(args.warm_calls)])
        apart = []
        for _ in range(args.warm_calls):
            time.sleep(args.space_s)  # not timed: the caller's other work
            apart.append(module.call(False))
        raw.append(r)
        cold.append(c)
        warm.append(w)
        spaced.append(C.median(apart))
        cold_ratio.append(c / r)
        warm_ratio.append(w / r)
        spaced_ratio.append(spaced[-1] / r)
    report = {
        "environment": env,
        "rounds": rounds,
        "warm_calls_per_round": args.warm_calls,
        "seconds": {
            "raw_start": C.median(raw),
            "cold_first": first_cold,
            "cold": C.median(cold),
            "warm_first": first_warm,
            "warm": C.median(warm),
            "warm_spaced": C.median(spaced),
        },
        "space_s": args.space_s,
        "ratio_to_raw": {
            "cold": C.median(cold_ratio),
            "warm": C.median(warm_ratio),
            "warm_spaced": C.median(spaced_ratio),
        },
        "target_warm_ratio": TARGET,
        "met": C.median(warm_ratio) <= TARGET,
    }
    s, q = report["seconds"], report["ratio_to_raw"]
    print(f"\n2 gloo ranks, a no-op function; medians of {rounds} rounds ({args.warm_calls} warm calls each)")
    print(f"{'':34}{'seconds':>9}{'x raw start':>13}")
    print(f"{'raw start (mp.spawn + gloo group)':34}{s['raw_start']:9.3f}{1.0:13.3f}")
    print(f"{'run_distributed fresh=True, first':34}{s['cold_first']:9.3f}")
    print(f"{'run_distributed fresh=True':34}{s['cold']:9.3f}{q['cold']:13.3f}")
    print(f"{'run_distributed, first (pool)':34}{s['warm_first']:9.3f}")
    print(f"{'run_distributed, warm back to back':34}{s['warm']:9.4f}{q['warm']:13.4f}")
    print(f"{'run_distributed, warm spaced':34}{s['warm_spaced']:9.4f}{q['warm_spaced']:13.4f}")
    print(f"target: warm <= {TARGET} x raw start: {'met' if report['met'] else 'NOT met'}")
    C.write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
