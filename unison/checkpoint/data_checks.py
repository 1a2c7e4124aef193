"""Checks of a checkpoint's data positions, before anything is loaded from them.

The positions a resume puts back (the engine's place in its epoch, the sampler's, each rank's
own data state) come from a file, which may be damaged or crafted: a negative position would
replay the epoch, a huge one would leave it empty, silently. Each value is checked for its type
and range where the checkpoint says the bound (the dataset size, the epoch length), and the
per-rank lists for the saving world size. A rank's data state is the source's own format:
the counts unison and torchdata keep in it (``consumed``, ``_num_yielded``...) are checked
wherever they sit. Plain values only, the same file on every rank: every rank agrees.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from unison.checkpoint.checkpoint_error import CheckpointError

COUNTS = frozenset(
    {
        "epoch",
        "consumed",
        "samples_yielded",
        "_num_yielded",
        "_sampler_iter_yielded",
        "_snapshot_step",
        "_steps_since_snapshot",
    }
)
"""Keys of a rank's data state that hold counts (shard_stream's, TrainSampler's, torchdata's)."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Checker:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, path: str, value: Any, expected: str) -> NoReturn:
        raise CheckpointError(
            f"Checkpoint {self.source}: {path} is {value!r}; expected {expected}. The file is damaged or was not "
            "written by unison's Checkpoint: resume from another checkpoint (resume='auto' takes the newest "
            "complete one), or start the run afresh."
        )

    def count(self, path: str, value: Any, upper: int | None = None, what: str = "") -> None:
        """``value`` is an int in ``[0, upper]`` (no upper bound when None)."""
        if _is_int(value) and value >= 0 and (upper is None or value <= upper):
            return
        bound = f"an int from 0 to {upper}{what}" if upper is not None else "a non-negative int"
        self.fail(path, value, bound)

    def per_rank(self, path: str, value: Any, world_size: int) -> Sequence[Any]:
        """``value`` is a list of one entry per rank of the saving run."""
        if not isinstance(value, (list, tuple)):
            self.fail(path, value, f"a list of one entry per rank ({world_size})")
        if len(value) != world_size:
            self.fail(
                path,
                f"{type(value).__name__} of {len(value)} entries",
                f"one entry per rank of the run that saved it ({world_size})",
            )
        return value

    def counts_inside(self, path: str, state: Any) -> None:
        """The counts of a rank's data state, wherever they sit in it."""
        if isinstance(state, Mapping):
            for key, value in state.items():
                inner = f"{path}.{key}"
                if key in COUNTS and not isinstance(value, (Mapping, list, tuple)) and value is not None:
                    self.count(inner, value)
                else:
                    self.counts_inside(inner, value)
        elif isinstance(state, (list, tuple)):
            for i, value in enumerate(state):
                self.counts_inside(f"{path}[{i}]", value)


def check_data_positions(state: Mapping[str, Any], *, source: str) -> None:
    """Checks the engine's position, the sampler's and each rank's data state of a checkpoint.

    Raises:
        CheckpointError: naming the file, the key path, the value and what was expected.
    """
    checker = _Checker(source)
    meta = state.get("meta") or {}
    world = meta.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        checker.fail("meta.world_size", world, "a positive int")
    trainer = state.get("trainer")
    extra = trainer.get("unison") if isinstance(trainer, Mapping) else None
    position = extra.get("position") if isinstance(extra, Mapping) else None
    if position is not None:
        if not isinstance(position, (list, tuple)) or len(position) != 2:
            checker.fail("trainer.unison.position", position, "[completed epochs, iterations into the next]")
        length = trainer.get("epoch_length") if isinstance(trainer, Mapping) else None
        checker.count("trainer.unison.position[0]", position[0])
        upper = length if isinstance(length, int) and not isinstance(length, bool) and length > 0 else None
        checker.count("trainer.unison.position[1]", position[1], upper, " (the epoch length)")
    _check_sampler(checker, state.get("sampler"), world)
    _check_data(checker, state.get("data"), world)


def _check_sampler(checker: _Checker, sampler: Any, world: int) -> None:
    if sampler is None:
        return
    if not isinstance(sampler, Mapping):
        checker.fail("sampler", type(sampler).__name__, "a mapping (the sampler's state) or None")
    size = sampler.get("dataset_size")
    if size is not None:
        checker.count("sampler.dataset_size", size)
    upper, what = (size, " (the dataset size)") if _is_int(size) else (None, "")
    for key in ("epoch", "consumed"):
        if key in sampler:
            checker.count(f"sampler.{key}", sampler[key], upper if key == "consumed" else None, what)
    by_rank = sampler.get("consumed_by_rank")
    if by_rank is not None:
        for i, value in enumerate(checker.per_rank("sampler.consumed_by_rank", by_rank, world)):
            checker.count(f"sampler.consumed_by_rank[{i}]", value, upper, what)


def _check_data(checker: _Checker, data: Any, world: int) -> None:
    if data is None:
        return
    if not isinstance(data, Mapping):
        checker.fail("data", type(data).__name__, "a mapping (each rank's data state) or None")
    if data.get("kind") != "stateful":
        checker.fail("data.kind", data.get("kind"), "'stateful'")
    if data.get("scope") not in ("global", "rank"):
        checker.fail("data.scope", data.get("scope"), "'global' or 'rank'")
    if not isinstance(data.get("elastic"), bool):
        checker.fail("data.elastic", data.get("elastic"), "True or False")
    if not isinstance(data.get("source"), str):
        checker.fail("data.source", data.get("source"), "the source's type name")
    if data.get("world_size") != world:
        checker.fail(
            "data.world_size",
            data.get("world_size"),
            f"the world size of the save ({world}, meta.world_size)",
        )
    for rank, state in enumerate(checker.per_rank("data.by_rank", data.get("by_rank"), world)):
        checker.counts_inside(f"data.by_rank[{rank}]", state)
