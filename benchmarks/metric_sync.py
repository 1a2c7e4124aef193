"""Metric synchronisation: collectives and time per evaluation, ignite's metrics vs unison's.

N ranks (2 gloo processes on the CPU, one per GPU with NCCL) evaluate the MLP
784-512-512-10 with four metrics that both libraries have:

    accuracy  ignite Accuracy                  unison Accuracy
    top5      ignite TopKCategoricalAccuracy   unison Accuracy(top_k=5)
    loss      ignite Loss(cross_entropy)       unison Loss(cross_entropy)
    brier     ignite MeanSquaredError          unison MeanSquaredError
              (of the true class's probability against 1, through output_transform)

    ignite  create_supervised_evaluator with ignite's metrics (each syncs its own state)
    unison  create_evaluator with unison's metrics (one all-reduce for all of them)

Both read the same loader (unison's EvalSampler: every sample once, no padding), so the
values must agree; the script checks that they do. Every ``torch.distributed``
collective is wrapped in the workers to count the calls and the time spent in them
during each evaluation. Two data sizes: "full" (2001 samples: 16 batches of 64 per
rank) and "tiny" (one batch per rank: the sync dominates). Runs interleave, rotated
every round; times are the slowest rank's, medians over rounds.

    python benchmarks/metric_sync.py          # ~30 s on 2 busy CPU cores
    python benchmarks/metric_sync.py --quick  # ~20 s
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

BATCH = 64
SIZES = {"full": 2001, "tiny": None}  # tiny: one batch per rank, set from the world size
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
)


class CollectiveCounter:
    """Wraps ``torch.distributed``'s collectives: counts the outermost calls and their time.

    Callers that look the function up on the module at call time (``dist.all_reduce``, as
    ignite and unison do) are seen; a collective made inside another (``all_gather_object``
    calls ``all_gather``) counts once.
    """

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.seconds = 0.0
        self.enabled = False
        self._depth = 0

    def install(self) -> None:
        import torch.distributed as dist

        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(name, fn))

    def _wrap(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._depth or not self.enabled:
                return fn(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                self.calls[name] += 1
                self.seconds += time.perf_counter() - start

        return counted

    def reset(self) -> None:
        self.calls.clear()
        self.seconds = 0.0


def worker(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    from ignite.engine import Engine as IgniteEngine
    from ignite.engine import create_supervised_evaluator
    from ignite.metrics import Accuracy as IgniteAccuracy
    from ignite.metrics import Loss as IgniteLoss
    from ignite.metrics import MeanSquaredError as IgniteMSE
    from ignite.metrics import TopKCategoricalAccuracy
    from torch.nn import functional as F
    from torch.utils.data import DataLoader

    from unison.distributed import EvalSampler, get_world_size
    from unison.distributed import device as rank_device
    from unison.engine import create_evaluator
    from unison.metrics import Accuracy, Loss, MeanSquaredError

    counter = CollectiveCounter()
    counter.install()
    device = rank_device()
    if device.type == "cpu":
        torch.set_num_threads(cfg["threads"])
    amp = cfg["amp"]
    model = C.build_mlp(seed=0).to(device)

    def true_class_prob(output: Any) -> tuple[Any, Any]:
        y_pred, y = output
        p = torch.softmax(y_pred.float(), dim=1).gather(1, y.unsqueeze(1)).squeeze(1)
        return p, torch.ones_like(p)

    def ignite_evaluator() -> Any:
        metrics = {
            "accuracy": IgniteAccuracy(device=device),
            "top5": TopKCategoricalAccuracy(k=5, device=device),
            "loss": IgniteLoss(F.cross_entropy, device=device),
            "brier": IgniteMSE(output_transform=true_class_prob, device=device),
        }
        if amp is None:
            return create_supervised_evaluator(model, metrics=metrics, device=device)

        # ignite's own amp mode is fp16 autocast: evaluate in bf16 as unison does
        def step(_: Any, batch: Any) -> Any:
            model.eval()
            x, y = (t.to(device, non_blocking=True) for t in batch)
            with torch.no_grad(), C.autocast(device.type, amp):
                return model(x), y

        engine = IgniteEngine(step)
        for name, metric in metrics.items():
            metric.attach(engine, name)
        return engine

    def unison_evaluator() -> Any:
        metrics = {
            "accuracy": Accuracy(),
            "top5": Accuracy(top_k=5),
            "loss": Loss(F.cross_entropy),
            "brier": MeanSquaredError(output_transform=true_class_prob),
        }
        return create_evaluator(model, metrics, amp=amp)

    builders = {"ignite": ignite_evaluator, "unison": unison_evaluator}
    out: dict[str, Any] = {}
    for size, samples in SIZES.items():
        dataset = C.classification_data(samples or BATCH * get_world_size(), seed=1)
        loader = DataLoader(dataset, batch_size=BATCH, sampler=EvalSampler(dataset))
        results: dict[str, dict[str, Any]] = {
            v: {"wall": [], "in_collectives": [], "collectives": [], "kinds": Counter()} for v in builders
        }
        values: dict[str, dict[str, float]] = {}
        for build in builders.values():  # warm-up
            build().run(loader)
        for r in range(cfg["repeats"]):
            for variant in C.rotated(list(builders), r):
                evaluator = builders[variant]()
                C.barrier(device)
                counter.reset()
                counter.enabled = True
                start = time.perf_counter()
                state = evaluator.run(loader)
                C.synchronize(device)
                wall = time.perf_counter() - start
                counter.enabled = False
                in_coll, calls = counter.seconds, sum(counter.calls.values())
                kinds = dict(counter.calls)
                wall, in_coll = C.slowest([wall, in_coll], device)
                res = results[variant]
                res["wall"].append(wall)
                res["in_collectives"].append(in_coll)
                res["collectives"].append(calls)
                res["kinds"].update(kinds)
                values[variant] = {k: float(v) for k, v in state.metrics.items()}
        out[size] = {
            "samples": len(dataset),
            "batches_per_rank": len(loader),
            "results": {v: {**r, "kinds": dict(r["kinds"])} for v, r in results.items()},
            "values": values,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_common_args(parser, repeats=31, quick_repeats=4)
    parser.add_argument(
        "--nproc", type=int, default=None, help="ranks; default 2 on the CPU, every GPU on CUDA"
    )
    args = parser.parse_args(argv)
    repeats = C.resolve_repeats(args)

    import torch

    from unison.distributed import launch

    device = C.resolve_device(args.device)
    nproc = args.nproc or (torch.cuda.device_count() if device == "cuda" else 2)
    cfg = {
        "nproc": nproc,
        "backend": "nccl" if device == "cuda" else "gloo",
        "threads": C.rank_threads(nproc),
        "amp": C.resolve_amp(args.amp, device),
        "repeats": repeats,
    }
    report: dict[str, Any] = {
        "benchmark": "metric_sync",
        **C.environment(device),
        "quick": args.quick,
        "config": cfg,
    }
    C.print_environment(report)
    if nproc < 2:
        print("only one rank: no collectives to count (CUDA needs one GPU per rank)")
    raw = launch(worker, cfg, nproc_per_node=nproc, backend=cfg["backend"], start_method="spawn")[0]

    report["evaluations"] = {}
    for size, data in raw.items():
        rows = {}
        for variant, r in data["results"].items():
            rows[variant] = {
                "collectives_per_evaluation": C.median(r["collectives"]),
                "collective_kinds_total": r["kinds"],
                "median_ms_per_evaluation": C.median(r["wall"]) * 1e3,
                "median_ms_in_collectives": C.median(r["in_collectives"]) * 1e3,
                "ratio_to_ignite": C.paired_ratio(r["wall"], data["results"]["ignite"]["wall"]),
                "spread": C.spread(r["wall"]),
                "ms_per_evaluation": [x * 1e3 for x in r["wall"]],
            }
        diff = max(
            abs(data["values"]["ignite"][k] - data["values"]["unison"][k]) for k in data["values"]["ignite"]
        )
        report["evaluations"][size] = {
            "samples": data["samples"],
            "batches_per_rank": data["batches_per_rank"],
            "results": rows,
            "values": data["values"],
            "max_abs_difference_of_values": diff,
        }
        C.print_table(
            f"{size}: {data['samples']} samples, {data['batches_per_rank']} batch(es) of <= {BATCH} per rank, "
            f"{nproc} {cfg['backend']} ranks, 4 metrics, {repeats} interleaved evaluations each (medians)",
            ["metrics", "collectives", "ms/eval", "ms in collectives", "x ignite", "spread"],
            [
                [
                    v,
                    f"{r['collectives_per_evaluation']:g}",
                    f"{r['median_ms_per_evaluation']:.2f}",
                    f"{r['median_ms_in_collectives']:.2f}",
                    f"{r['ratio_to_ignite']:.3f}",
                    f"{r['spread']:.2f}",
                ]
                for v, r in rows.items()
            ],
        )
        print(f"values agree: max |ignite - unison| = {diff:.2e}  ({data['values']['unison']})")
    full = report["evaluations"]["full"]["results"]["unison"]
    # bf16 outputs: ignite's Loss multiplies the bf16 batch loss by the batch size in bf16
    tolerance = 1e-5 if cfg["amp"] is None else 1e-2
    report["targets"] = [
        {
            "target": "unison: 1 collective per evaluation",
            "unison_collectives": full["collectives_per_evaluation"],
            "ignite_collectives": report["evaluations"]["full"]["results"]["ignite"][
                "collectives_per_evaluation"
            ],
            "met": full["collectives_per_evaluation"] == 1 if nproc > 1 else None,
        },
        {
            "target": "unison's values equal ignite's (same unpadded data)",
            "max_abs_difference": max(
                e["max_abs_difference_of_values"] for e in report["evaluations"].values()
            ),
            "tolerance": tolerance,
            "met": all(e["max_abs_difference_of_values"] < tolerance for e in report["evaluations"].values()),
        },
    ]
    C.print_targets(report["targets"])
    C.write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
