"""Streaming data: unison's stream loader against the same source in a raw loop, and the cost
of saving and restoring the stream's position.

The CPU, one torch thread per process, at 1 and 2 gloo ranks (``--ranks``; a world of 2 is
spawned). Each source yields the same MNIST-shaped samples (784 float32 features and a
class), read one epoch at a time in batches of 32 per rank by a trivial consumer (it counts
the batch's samples), with ``num_workers`` 0 and 2:

    generator   a plain Python generator over precomputed tensors, in an IterableDataset.
                raw: the generator read whole by every process, each keeping its items with
                ``itertools.islice`` (item i to rank i % W, a rank's items to its workers
                in turn). unison: the same generator, unsplit, in ``shard_stream`` (the same
                split). ``raw_own``: a generator reading only its own items, as a source
                that can seek does (a second table: the floor for any stream read whole).
    files       ``data.stream.files``' source: 8 ``torch.save``'d files of (features,
                classes), read by a reader yielding their rows. raw: the files chained
                and split with ``islice``; unison: ``shard_stream(FileStream(files, reader))``.
    hf          Hugging Face ``Dataset.from_dict(...).to_iterable_dataset(num_shards=4)``,
                torch format, ``split_dataset_by_node`` at 2 ranks; used as is by both (it
                deals its shards to the ranks and workers).
    webdataset  ``WebDataset`` over 4 local tar shards written with ``TarWriter`` (a
                ``.npy`` array and a ``.cls`` per sample), decoded to (array, class);
                ``nodesplitter=split_by_node`` at 2 ranks.

At 2 ranks every epoch starts on both ranks together and its time is the slower rank's.
Variants: ``raw`` is ``torch.utils.data.DataLoader(source, batch_size, num_workers)`` as
one writes it without unison; ``unison`` is ``prepare_loaders(train=source, ...)``: its
checks, torchdata's ``StatefulDataLoader`` and unison's collate. Both loaders are built
once and iterated every round (workers start at each epoch, in both alike); runs
interleave in an order rotated every round, and within a round each variant reads
``--inner`` epochs, interleaved (by default as many as fill about a second, at most 25:
many of a 5 ms epoch, one of a 2 s one) of which the round keeps the least wall and the
least CPU time (other jobs only ever add time to an epoch). Reported: samples/s of one whole epoch (the
median over rounds), and "x raw", the median over rounds of the paired ratio of epoch
times (unison / raw; 1.02 = 2% slower), with a bootstrap 95% interval; "x raw (CPU)", the
same of each epoch's CPU time: user and system time of every process that reads (the
process, ``time.process_time()``, and its loader workers, ``getrusage(RUSAGE_CHILDREN)``
once they exit at the epoch's end), summed over the ranks at 2 ranks: the work an epoch
costs the machine, which other jobs on the same cores lengthen far less than its wall
time (they take turns with it; they do not make it do more). Target: within 2% of raw,
judged on the wall-clock ratio where its interval resolves 2%, else on the CPU ratio (the
target line says which).

Data state, for each unison loader whose position can be saved (``data_position(loader)``
of kind "stateful"): halfway through an epoch, the time of ``save()``, the pickled size
of the state, the time of ``load(state)`` on a fresh loader, and the time from ``iter()``
to the first batch after that load (where the skipping happens) against a fresh
``iter()``'s first batch. The resumed batch is checked against the one the uninterrupted
epoch yields next (at one rank). A WebDataset's position cannot be saved (kind "none"):
its row says so.

    python benchmarks/stream_loading.py            # ~6 minutes on 2 busy cores
    python benchmarks/stream_loading.py --quick    # a smoke run (1 rank, num_workers 0), ~30 s
    python benchmarks/stream_loading.py --sources generator --workers 0 --repeats 15 --json s.json
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import _streams as S  # noqa: E402

SOURCES = S.SOURCES
WORKERS = (0, 2)
RANKS = (1, 2)
BATCH = 32
SHARDS = S.SHARDS
TARGET = 1.02
ROUND_S = 1.0
"""A round reads each variant's epochs for about this long (more epochs of a short one)."""
MAX_INNER = 25


def build_loader(dataset: Any, variant: str, workers: int) -> Any:
    if variant != "unison":
        from torch.utils.data import DataLoader

        # workers forked, as a raw script's are on Linux (a spawned rank would spawn them)
        context = {"multiprocessing_context": "fork"} if workers else {}
        return DataLoader(dataset, batch_size=BATCH, num_workers=workers, **context)
    from unison.distributed import prepare_loaders

    loader, _ = prepare_loaders(train=dataset, batch_size=BATCH, num_workers=workers)
    return loader


def count(batch: Any) -> int:
    """The trivial consumer: the batch's samples."""
    first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return len(first)


def cpu_seconds() -> float:
    """CPU seconds (user and system) of this process and of the children it has waited for: its
    loader's workers, which a loader joins at the end of each epoch (persistent ones aside)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def epoch(loader: Any) -> tuple[float, float, int]:
    """Wall seconds to read one epoch, CPU seconds spent on it (this process and its workers), and
    its samples."""
    start, cpu, n = time.perf_counter(), cpu_seconds(), 0
    for batch in loader:
        n += count(batch)
    return time.perf_counter() - start, cpu_seconds() - cpu, n


def _first(batch: Any) -> Any:
    return batch["x"] if isinstance(batch, dict) else batch[0]


def data_state(make: Callable[[str], Any], workers: int, samples: int) -> dict[str, Any]:
    """Save and load of the unison loader's position halfway through an epoch (see the docstring)."""
    import torch

    from unison.distributed.data_state import data_position

    loader = build_loader(make("unison"), "unison", workers)
    position = data_position(loader)
    if position.kind != "stateful":
        return {"kind": position.kind, "source": position.source}
    assert position.save is not None
    half = samples // BATCH // 2
    it = iter(loader)
    for _ in range(half):
        next(it)
    start = time.perf_counter()
    state = position.save()
    save_s = time.perf_counter() - start
    size = len(pickle.dumps(state))
    expected = _first(next(it))  # what the uninterrupted epoch reads next
    del it
    fresh = build_loader(make("unison"), "unison", workers)
    start = time.perf_counter()
    next(iter(fresh))
    first_fresh_s = time.perf_counter() - start
    resumed = build_loader(make("unison"), "unison", workers)
    resumed_position = data_position(resumed)
    assert resumed_position.load is not None
    start = time.perf_counter()
    resumed_position.load(state)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    got = _first(next(iter(resumed)))
    first_resumed_s = time.perf_counter() - start
    if not torch.equal(got, torch.as_tensor(expected)):
        raise SystemExit(
            f"the resumed loader's first batch is not the one the epoch yields next ({position.source})"
        )
    return {
        "kind": position.kind,
        "source": position.source,
        "save_s": save_s,
        "load_s": load_s,
        "state_bytes": size,
        "first_batch_fresh_s": first_fresh_s,
        "first_batch_resumed_s": first_resumed_s,
    }


class _Exchanges:
    """Every rank's values, through the process group's store rather than a collective.

    A gloo collective's thread can create a Python thread state (taking CPython's lock on them)
    just as the rank forks a loader worker, and a worker forked then waits for that lock for good
    in CPython 3.11's after-fork clean-up: seen here at 2 ranks and 2 workers, one epoch in ~40.
    The store's client works in the calling thread.
    """

    def __init__(self) -> None:
        import torch.distributed as dist

        self.store = dist.distributed_c10d._get_default_store()
        self.rank, self.world, self.count = dist.get_rank(), dist.get_world_size(), 0

    def __call__(self, values: list[float]) -> list[list[float]]:
        """Waits for every rank's ``values`` (a barrier too), in rank order."""
        self.count += 1
        key = f"stream_loading/{self.count}"
        self.store.set(f"{key}/{self.rank}", json.dumps(values))
        return [json.loads(self.store.get(f"{key}/{r}")) for r in range(self.world)]


_exchange: _Exchanges | None = None


def _epoch_everywhere(loader: Any, world: int) -> tuple[float, float, int]:
    """One epoch on every rank, started together: the slowest rank's wall seconds, the CPU seconds
    of every rank and worker summed (the work the epoch cost the machine), and this rank's samples."""
    global _exchange
    if world == 1:
        return epoch(loader)
    _exchange = _exchange or _Exchanges()
    _exchange([])
    seconds, cpu, n = epoch(loader)
    ranks = _exchange([seconds, cpu])
    return max(r[0] for r in ranks), sum(r[1] for r in ranks), n


def inner_epochs(epoch_s: float, inner: int | None) -> int:
    """Epochs of each variant per round: ``inner``, or as many as fill ``ROUND_S`` (at most ``MAX_INNER``)."""
    if inner is not None:
        return inner
    return max(1, min(MAX_INNER, round(ROUND_S / max(epoch_s, 1e-6))))


def measure(
    name: str,
    data: dict[str, Any],
    workers_list: list[int],
    repeats: int,
    rank: int = 0,
    world: int = 1,
    inner: int | None = None,
) -> list[dict]:
    make = S.sources(name, data, rank, world)
    names = S.variants(name)
    samples = len(data["y"])
    out = []
    for workers in workers_list:
        loaders = {v: build_loader(make(v), v, workers) for v in names}
        # warm-up: imports, first file reads, first worker start; its time (the slowest rank's) sets
        # the epochs per round, the same on every rank
        k = inner_epochs(max(_epoch_everywhere(loaders[v], world)[0] for v in names), inner)
        times: dict[str, list[float]] = {v: [] for v in names}
        cpu: dict[str, list[float]] = {v: [] for v in names}
        for r in range(repeats):
            best = {v: [float("inf"), float("inf")] for v in names}
            for i in range(k):  # k epochs of each variant, interleaved; a round keeps each one's least
                for v in C.rotated(names, r + i):
                    seconds, cpu_s, n = _epoch_everywhere(loaders[v], world)
                    if n != samples // world:
                        raise SystemExit(
                            f"{name}, {v}, num_workers={workers}, rank {rank} of {world}: read {n} samples, "
                            f"expected {samples // world}"
                        )
                    best[v] = [min(best[v][0], seconds), min(best[v][1], cpu_s)]
            for v in names:
                times[v].append(best[v][0])
                cpu[v].append(best[v][1])
        state: dict[str, Any] = {}
        if world == 1:
            states = [data_state(make, workers, samples) for _ in range(max(1, min(repeats, 3)))]
            state = dict(states[0])
            for key in ("save_s", "load_s", "first_batch_fresh_s", "first_batch_resumed_s"):
                if key in state:
                    state[key] = C.median(s[key] for s in states)
        ratio = C.paired_ratio(times["unison"], times["raw"])
        row = {
            "source": name,
            "ranks": world,
            "num_workers": workers,
            "samples": samples,
            "repeats": repeats,
            "epochs_per_round": k,
            "samples_per_s": {v: samples / C.median(times[v]) for v in names},
            "epoch_s": {v: times[v] for v in names},
            "spread": {v: C.spread(times[v]) for v in names},
            "ratio_to_raw": ratio,
            "ratio_of_medians": C.median(times["unison"]) / C.median(times["raw"]),
            "ratio_ci95": list(C.ratio_ci(times["unison"], times["raw"])),
            "cpu_s": {v: cpu[v] for v in names},
            "cpu_ratio_to_raw": C.paired_ratio(cpu["unison"], cpu["raw"]),
            "cpu_ratio_ci95": list(C.ratio_ci(cpu["unison"], cpu["raw"])),
            "data_state": state,
        }
        if "raw_own" in names:
            row["ratio_to_raw_own"] = C.paired_ratio(times["unison"], times["raw_own"])
        out.append(row)
        if rank == 0:
            print(
                f"  {name}, {world} rank(s), num_workers={workers}: raw {row['samples_per_s']['raw']:.0f}/s, "
                f"unison {row['samples_per_s']['unison']:.0f}/s, x raw {ratio:.3f}, "
                f"x raw (CPU) {row['cpu_ratio_to_raw']:.3f}",
                flush=True,
            )
    return out


def judge(row: dict[str, Any]) -> dict[str, Any]:
    """The 2% target of one row, judged on the epoch's wall time where its interval resolves 2%, else
    on its CPU time (which other jobs' load barely moves), saying so."""
    name = (
        f"{row['source']}, {row['ranks']} rank(s), num_workers={row['num_workers']}: unison within 2% of raw"
    )
    wall = C.judge(f"{name} (epoch time, x raw)", row["ratio_to_raw"], TARGET, tuple(row["ratio_ci95"]))
    if wall["conclusive"]:
        return {**wall, "measure": "wall"}
    low, high = row["ratio_ci95"]
    return {
        **C.judge(
            f"{name} (CPU time, x raw (CPU); the wall-clock interval {low:.3f}-{high:.3f} cannot resolve 2%)",
            row["cpu_ratio_to_raw"],
            TARGET,
            tuple(row["cpu_ratio_ci95"]),
        ),
        "measure": "cpu",
    }


def rank_worker(cfg: dict[str, Any]) -> list[dict]:
    """Every source at ``cfg['world']`` ranks (run by ``launch`` in each rank)."""
    import torch

    import unison.distributed as ud

    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    torch.set_num_threads(1)
    data = S.write_data(cfg["samples"], Path(cfg["folder"]), write=False)
    rank, world = ud.get_rank(), ud.get_world_size()
    results: list[dict] = []
    for name in cfg["sources"]:
        results += measure(name, data, cfg["workers"], cfg["repeats"], rank, world, cfg["inner"])
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES))
    parser.add_argument(
        "--workers",
        nargs="+",
        type=int,
        default=None,
        help="num_workers values (default 0 2; 0 with --quick)",
    )
    parser.add_argument(
        "--samples", type=int, default=None, help="samples per epoch (default 2048; 512 with --quick)"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="interleaved rounds (default 5; 2 with --quick)"
    )
    parser.add_argument(
        "--ranks", nargs="+", type=int, default=None, help="world sizes (default 1 2; 1 with --quick)"
    )
    parser.add_argument(
        "--inner",
        type=int,
        default=None,
        help=f"epochs of each variant per round, the least kept (default: about {ROUND_S:g} s of them, "
        f"at most {MAX_INNER}; 1 with --quick)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer rounds and samples: a smoke run")
    parser.add_argument("--json", type=Path, default=None, help="write the report here, as JSON")
    args = parser.parse_args(argv)
    ranks_list = args.ranks if args.ranks is not None else ([1] if args.quick else list(RANKS))
    if any(r < 1 for r in ranks_list):
        raise SystemExit(f"--ranks must be >= 1, got {ranks_list}")
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else 5)
    samples = args.samples if args.samples is not None else (512 if args.quick else 2048)
    workers_list = args.workers if args.workers is not None else ([0] if args.quick else list(WORKERS))
    if repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {repeats}")
    inner = 1 if args.quick and args.inner is None else args.inner
    if inner is not None and inner < 1:
        raise SystemExit(f"--inner must be >= 1, got {inner}")
    if samples < 4 * BATCH * SHARDS:
        raise SystemExit(f"--samples must be >= {4 * BATCH * SHARDS} (4 batches per shard), got {samples}")
    if any(w < 0 for w in workers_list):
        raise SystemExit(f"--workers must be >= 0, got {workers_list}")

    import torch

    # torchdata's loader calls a torch function that torch now deprecates (a warning per loader)
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    torch.set_num_threads(1)
    env = C.environment("cpu")
    C.print_environment(env)
    folder = Path(tempfile.mkdtemp(prefix="unison-stream-"))
    results: list[dict] = []
    try:
        data = S.write_data(samples, folder)
        for world in ranks_list:
            if world == 1:
                for name in args.sources:
                    results += measure(name, data, workers_list, repeats, inner=inner)
                continue
            from unison.distributed import launch

            cfg = {
                "samples": samples,
                "folder": str(folder),
                "sources": args.sources,
                "workers": workers_list,
                "repeats": repeats,
                "inner": inner,
            }
            results += launch(rank_worker, cfg, nproc_per_node=world, backend="gloo", start_method="spawn")[0]
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    C.print_table(
        f"One epoch of {samples} samples, batch {BATCH}, median of {repeats} rounds, each the least of "
        "its epochs (x raw: median of paired ratios of epoch times; CPU: of the epochs' CPU times)",
        [
            "source",
            "ranks",
            "workers",
            "raw samples/s",
            "unison samples/s",
            "x raw",
            "95% CI",
            "x raw (CPU)",
            "95% CI (CPU)",
            "spread raw/unison",
        ],
        [
            [
                r["source"],
                r["ranks"],
                r["num_workers"],
                f"{r['samples_per_s']['raw']:.0f}",
                f"{r['samples_per_s']['unison']:.0f}",
                f"{r['ratio_to_raw']:.3f}",
                f"{r['ratio_ci95'][0]:.3f}-{r['ratio_ci95'][1]:.3f}",
                f"{r['cpu_ratio_to_raw']:.3f}",
                f"{r['cpu_ratio_ci95'][0]:.3f}-{r['cpu_ratio_ci95'][1]:.3f}",
                f"{r['spread']['raw']:.2f}/{r['spread']['unison']:.2f}",
            ]
            for r in results
        ],
    )
    own = [r for r in results if "ratio_to_raw_own" in r]
    if own:
        C.print_table(
            "The generator against a raw source that reads only its own items (what shard_stream cannot do)",
            ["ranks", "workers", "own-items samples/s", "unison samples/s", "x own-items raw"],
            [
                [
                    r["ranks"],
                    r["num_workers"],
                    f"{r['samples_per_s']['raw_own']:.0f}",
                    f"{r['samples_per_s']['unison']:.0f}",
                    f"{r['ratio_to_raw_own']:.3f}",
                ]
                for r in own
            ],
        )
    rows = []
    for r in results:
        s = r["data_state"]
        if not s:  # measured at one rank only
            continue
        head = [r["source"], r["num_workers"], s["source"]]
        if s["kind"] != "stateful":
            rows.append([*head, f"kind {s['kind']}: not saved", "", "", "", ""])
            continue
        rows.append(
            [
                *head,
                f"{s['save_s'] * 1e3:.2f}",
                f"{s['state_bytes']}",
                f"{s['load_s'] * 1e3:.3f}",
                f"{s['first_batch_fresh_s'] * 1e3:.1f}",
                f"{s['first_batch_resumed_s'] * 1e3:.1f}",
            ]
        )
    C.print_table(
        "Data state halfway through an epoch (unison loader; medians)",
        [
            "source",
            "workers",
            "position from",
            "save() ms",
            "pickled B",
            "load() ms",
            "1st batch ms",
            "resumed ms",
        ],
        rows,
    )
    targets = [judge(r) for r in results]
    C.print_targets(targets)
    try:
        env["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    report = {
        "benchmark": "stream_loading",
        **env,
        "quick": args.quick,
        "config": {
            "samples": samples,
            "batch_size": BATCH,
            "shards": SHARDS,
            "files": S.FILES,
            "repeats": repeats,
            "inner": inner,
            "round_s": ROUND_S,
            "ranks": ranks_list,
        },
        "results": results,
        "targets": targets,
    }
    C.write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
