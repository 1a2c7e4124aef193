"""A sharded resume on several nodes, simulated on one: which files each rank checks before it loads.

Before a sharded resume every rank checks a share of the folder's files (size and CRC-32),
then loads its shards. On a cluster each node has its own page cache: a file one node
checked is cold for another. Two ways of sharing the check are set side by side:

    name order   the files at a rank's positions in the folder's name order (unison before:
                 at 2 ranks rank 0 checked ``__1_0.distcp`` and rank 1 ``__0_0.distcp``)
    own files    each data file ``__<r>_<n>.distcp`` checked by rank r (modulo the world
                 size): the rank whose load reads it next (``sharded_check.share_of``)

One machine has one page cache, so the nodes are simulated: after the check and before the
load, rank 0 drops from the cache every data file that the rank which loads it (its
writer, at the world size it was written at) did not check (:func:`cold_for_loader`).
Every resume starts cold (every file dropped first), as ``checkpoint_stall.py``'s does.
The model: FSDP2 at 2 gloo ranks, ``--size-mb`` of float32 Linear layers, SGD; one save,
then ``--repeats`` resumes each way, alternating; rank 0's ``resume("auto")`` is timed.

    python benchmarks/sharded_check_share.py                      # 1 GB, 6 rounds: ~2 minutes
    python benchmarks/sharded_check_share.py --size-mb 100 --repeats 2 --json share.json
    python benchmarks/sharded_check_share.py --quick              # a smoke run, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

WAYS = ("name order", "own files")


def name_order(names: Iterable[str], share: tuple[int, int]) -> list[str]:
    """The share ``(k, n)`` of the check as unison gave it before: every n-th file in name order.

    Example:
        >>> name_order([".metadata", "__0_0.distcp", "__1_0.distcp", "rest.pt"], (0, 2))
        ['.metadata', '__1_0.distcp']
    """
    return sorted(names)[share[0] :: share[1]]


def cold_for_loader(
    names: Iterable[str], world: int, share_of: Callable[[Iterable[str], tuple[int, int]], list[str]]
) -> list[str]:
    """The data files a node's page cache would not hold when its rank loads them: those that the
    rank which wrote them (and, at the same world size, loads them) did not check.

    Example:
        >>> names = [".metadata", "__0_0.distcp", "__1_0.distcp", "rest.pt"]
        >>> cold_for_loader(names, 2, name_order)
        ['__0_0.distcp', '__1_0.distcp']
    """
    from unison.checkpoint.sharded_check import writer_of

    names = sorted(names)
    checker = {n: k for k in range(world) for n in share_of(names, (k, world))}
    return [n for n in names if (r := writer_of(n)) is not None and checker.get(n) != r % world]


def worker(cfg: dict[str, Any]) -> dict[str, list[float]]:
    """Runs on every rank: one save, then resumes with each way of sharing the check."""
    import torch
    from checkpoint_stall import build, one_run, resume_seconds

    import unison.checkpoint.sharded_check as check
    import unison.handlers.checkpoint as handler
    from unison.distributed import barrier, get_rank, get_world_size, prepare_model

    torch.set_num_threads(cfg["threads"])
    model = prepare_model(build(cfg["width"], cfg["layers"]), strategy="fsdp")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(get_rank())
    data = [(torch.randn(4, cfg["width"], generator=gen), torch.randn(4, cfg["width"], generator=gen))]
    folder = Path(cfg["root"]) / "sharded"
    one_run(model, optimizer, data, folder, "sync", 2)
    own_files, load_states = check.share_of, handler.load_states

    def on_nodes(objects: Any, state: Any, path: Path, to_save: Any) -> Any:
        barrier()  # every rank's check is done
        if get_rank() == 0:
            names = json.loads((path / "checksums.json").read_text())["files"]
            for name in cold_for_loader(names, get_world_size(), check.share_of):
                fd = os.open(path / name, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        barrier()
        return load_states(objects, state, path, to_save)

    handler.load_states = on_nodes
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    try:
        for round_index in range(cfg["rounds"]):
            for way in C.rotated(WAYS, round_index):
                check.share_of = name_order if way == "name order" else own_files
                seconds[way].append(resume_seconds(model, optimizer, folder))
    finally:
        check.share_of, handler.load_states = own_files, load_states
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mb", type=float, default=1024, help="the model's size (default 1024)")
    parser.add_argument("--repeats", type=int, default=6, help="interleaved resumes each way (default 6)")
    parser.add_argument(
        "--dir", type=Path, default=None, help="the folder to write into (default: a temp dir)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the report here, as JSON")
    parser.add_argument("--quick", action="store_true", help="20 MB, 2 rounds: checks that it runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.size_mb, args.repeats = 20, 2

    from checkpoint_stall import sized

    from unison.distributed import launch

    env = C.environment("cpu")
    C.print_environment(env)
    width, layers = sized(args.size_mb)
    root = Path(tempfile.mkdtemp(prefix="unison-share-", dir=args.dir))
    cfg = {
        "width": width,
        "layers": layers,
        "rounds": args.repeats,
        "root": str(root),
        "threads": C.rank_threads(2),
    }
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # gloo ranks on the CPU
    try:
        seconds = launch(worker, cfg, nproc_per_node=2, backend="gloo", start_method="spawn")[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = [
        [way, f"{C.median(s) * 1e3:.0f}", " ".join(f"{x * 1e3:.0f}" for x in s)] for way, s in seconds.items()
    ]
    C.print_table(
        f"Sharded resume at 2 ranks, two nodes simulated, {layers} x Linear({width}, {width}), "
        f"median of {args.repeats}",
        ["check shared by", "resume ms", "each round, ms"],
        rows,
    )
    ratio = C.median(seconds["own files"]) / C.median(seconds["name order"])
    print(f"\nown files / name order: {ratio:.2f}x the time")
    C.write_json(
        args.json,
        {
            "benchmark": "sharded_check_share",
            "environment": env,
            "config": {"width": width, "layers": layers, "rounds": args.repeats},
            "resume_s": seconds,
            "own_over_name_order": ratio,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
