"""The loaders of a run, planned once per section: :class:`LoaderPlan`, :func:`loader_plans`.

Each section that has data (``training``, ``validation``, ``testing``) gets one frozen
:class:`LoaderPlan` with every DataLoader key it takes, its defaults already applied: a key the
``validation`` section leaves out comes from ``training`` (the batch per rank, ``pin_memory``,
``prefetch_factor``; workers default to 0 for validation), and one ``testing`` leaves out comes
from ``validation``. A section's ``shuffle`` and ``drop_last`` are its own; every section's
seed is ``training.seed``. The build steps (:func:`~unison.recipe.build.assemble.build_loaders`,
:func:`~unison.recipe.build.eval_loaders.eval_loader`) read these plans, never the config.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from unison.config import Config
from unison.config.batch_sizes import BatchSizes, batch_sizes

Section = Literal["training", "validation", "testing"]


@dataclass(frozen=True)
class LoaderPlan:
    """One section's loader: what ``prepare_loaders`` and ``DataLoader`` take for it.

    Attributes:
        section: ``training``, ``validation`` or ``testing``.
        batch_size: samples per rank per batch.
        shuffle: a new order each epoch (training) or each evaluation (the same on every rank).
        drop_last: whether each rank drops its last incomplete batch.
        seed: the seed of the order (``training.seed``).
        num_workers: DataLoader worker processes per rank.
        pin_memory: pin host memory for faster copies to a GPU.
        prefetch_factor: batches each worker loads ahead; None for the DataLoader's default
            (always None for an evaluation loader without workers, which refuses it).
        collate_fn: what joins items into batches (``<section>.collate``); None for the default.
    """

    section: Section
    batch_size: int
    shuffle: bool
    drop_last: bool
    seed: int
    num_workers: int
    pin_memory: bool
    prefetch_factor: int | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None

    def worker_kwargs(self) -> dict[str, Any]:
        """``num_workers``, ``pin_memory`` and, when set, ``prefetch_factor``: as DataLoader takes them.

        Example:
            >>> LoaderPlan("validation", 4, False, False, 0, 2, True, 3).worker_kwargs()
            {'num_workers': 2, 'pin_memory': True, 'prefetch_factor': 3}
        """
        kwargs: dict[str, Any] = {"num_workers": self.num_workers, "pin_memory": self.pin_memory}
        if self.prefetch_factor is not None:
            kwargs["prefetch_factor"] = self.prefetch_factor
        return kwargs


@dataclass(frozen=True)
class LoaderPlans:
    """The loaders of the three sections, each defaulted from the section before it."""

    training: LoaderPlan
    validation: LoaderPlan
    testing: LoaderPlan


def loader_plans(
    config: Config,
    collate: Mapping[str, Callable[[list[Any]], Any] | None] | None = None,
    sizes: BatchSizes | None = None,
) -> LoaderPlans:
    """Every section's :class:`LoaderPlan` of ``config``; ``collate`` maps a section to its ``collate_fn``;
    ``sizes``: each section's batch per rank at the run's world size (default: at one rank).

    Example:
        >>> from unison.config import Config
        >>> c = Config()
        >>> c.training.pin_memory, c.validation.num_workers, c.testing.drop_last = True, 2, True
        >>> c.training.batch_size = 8
        >>> t = loader_plans(c).testing
        >>> t.num_workers, t.pin_memory, t.drop_last, t.batch_size
        (2, True, True, 8)
    """
    t, v, s = config.training, config.validation, config.testing
    sizes = sizes if sizes is not None else batch_sizes(config, 1)
    collate = collate or {}
    training = LoaderPlan(
        "training", sizes.training, t.shuffle, t.drop_last, t.seed, t.num_workers, t.pin_memory,
        t.prefetch_factor, collate.get("training"),
    )  # fmt: skip
    v_workers = v.num_workers
    v_pin = t.pin_memory if v.pin_memory is None else v.pin_memory
    v_prefetch = t.prefetch_factor if v.prefetch_factor is None else v.prefetch_factor
    validation = LoaderPlan(
        "validation", sizes.validation, v.shuffle, v.drop_last, t.seed, v_workers, v_pin,
        v_prefetch if v_workers > 0 else None, collate.get("validation"),
    )  # fmt: skip
    s_workers = v_workers if s.num_workers is None else s.num_workers
    s_prefetch = v_prefetch if s.prefetch_factor is None else s.prefetch_factor
    testing = LoaderPlan(
        "testing", sizes.testing, s.shuffle, s.drop_last, t.seed,
        s_workers, v_pin if s.pin_memory is None else s.pin_memory,
        s_prefetch if s_workers > 0 else None, collate.get("testing"),
    )  # fmt: skip
    return LoaderPlans(training, validation, testing)


def training_data_key(config: Config) -> tuple[tuple[str, ...], str]:
    """The key that names the training data (``data.stream.files`` with its reader,
    ``data.stream.hf_dataset``, ``data.build``, ``data.files``), and the fix of data that yields no
    batch: what a trainer's empty epoch is reported at."""
    data = config.data
    stream = data.stream
    if stream is not None and stream.files is not None:
        fix = f"name files that hold training samples, which data.stream.reader ({stream.reader}) yields"
        return ("data", "stream", "files"), fix
    if stream is not None:
        return ("data", "stream", "hf_dataset"), "give a split that has rows"
    if data.build is not None:
        return ("data", "build"), "return training data that yields samples"
    return ("data", "files"), "name files that hold training samples"
