"""``data``: where a run's datasets come from, a function of the user's or files read once.

A section of the schema (:mod:`unison.config.schema`), in a module of its own. Its fields
carry the same metadata as :func:`~unison.config.schema.option`'s, for the reference page.
Two ways to give the data, one per config:

- ``data.build``: ``fn(seed, **data.kwargs) -> (train, val[, test])``, the user's own (a parameter
  named ``world_size`` gets the run's world size);
- ``data.files`` and ``data.reader`` (QuantumGrav's keys): one
  :class:`~unison.distributed.FileDataset` over the files, split by ``data.split`` with
  ``training.seed`` (:mod:`unison.recipe.planning.file_data`);
- ``data.stream``: training data streamed from files or a Hugging Face dataset on disk
  (:mod:`unison.config.stream_config`, :mod:`unison.recipe.planning.stream_files`).

:func:`check_data` checks the section's values; it runs inside
:func:`~unison.config.validate`.
"""

# No ``from __future__ import annotations``: the schema reads these fields' types with its own
# names (schema._hints), which hold no StreamConfig, so they are objects here, not strings.
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from unison.config.loader import KeyPath, PyObjectRef, RawConfig
from unison.config.stream_config import StreamConfig, check_stream


def _key(default: Any, doc: str, slot: str | None = None) -> Any:
    if isinstance(default, (dict, list)):
        value = default
        return field(
            default_factory=lambda: type(value)(value), metadata={"doc": doc, "alias": None, "slot": slot}
        )
    return field(default=default, metadata={"doc": doc, "alias": None, "slot": slot})


INSTEAD_OF_BUILD = ("files", "stream")
"""The keys that name the training data in place of ``data.build`` (the required key): one of the three."""
FILE_KEYS = (
    "files", "reader", "count", "pre_transform", "pre_filter", "transform", "output", "validate_data",
    "n_processes", "chunksize", "split", "float_type", "int_type", "safe_globals",
)  # fmt: skip
"""The keys that describe a file-backed dataset; none of them is read with ``data.build``."""


@dataclass
class DataConfig:
    build: PyObjectRef | None = _key(
        None,
        "fn(seed, **kwargs) -> (train, val, test) datasets; test may be None (or give files and reader); a "
        "parameter named world_size gets the run's",
        slot="data",
    )
    kwargs: dict[str, Any] = _key({}, "keyword arguments of build")
    files: list[str] | None = _key(
        None,
        "files or zarr stores read into one FileDataset (docs/data.md), then split by data.split; relative "
        "to the config's folder (and kept inside it) unless absolute",
    )
    reader: PyObjectRef | None = _key(
        None,
        "reader(path, index) -> sample, or QuantumGrav's read_data(store, idx, float_dtype, int_dtype, "
        "validate_data), given the zarr store opened read-only (chosen by its required parameters: 2 or 5)",
        slot="data_function",
    )
    count: PyObjectRef | None = _key(
        None,
        "count(path) -> samples in a file; default the reader's count method, or the zarr store's",
        slot="data_function",
    )
    pre_transform: PyObjectRef | None = _key(
        None, "sample -> item, run once per sample into the cache", slot="data_function"
    )
    pre_filter: PyObjectRef | None = _key(
        None, "sample -> bool, run once per sample before pre_transform (needs output)", slot="data_function"
    )
    transform: PyObjectRef | None = _key(None, "item -> item, run at every access", slot="data_function")
    output: str | None = _key(
        None,
        "the cache's parent folder: items are cached in <output>/items, built by rank 0 and reused by later "
        "runs; relative to the config's folder (and kept inside it) unless absolute; null: no cache",
    )
    validate_data: bool = _key(
        True, "check every item once: no None, nan or inf (the error names file and sample)"
    )
    n_processes: int = _key(1, "processes that preprocess the files (on rank 0)")
    chunksize: int = _key(1000, "samples per cache file and per unit of preprocessing work")
    shuffle: bool | None = _key(
        None,
        "QuantumGrav's; read, not used: the split is drawn from training.seed and the training order is "
        "training.shuffle (a log line says so)",
    )
    split: list[float] = _key(
        [0.8, 0.1, 0.1], "fractions of the items for train, validation (and test), summing to 1"
    )
    float_type: Literal["float16", "bfloat16", "float32", "float64"] = _key(
        "float32", "float_dtype a QuantumGrav reader is given (torch.<name>)"
    )
    int_type: Literal["int32", "int64"] = _key(
        "int64", "int_dtype a QuantumGrav reader is given (torch.<name>)"
    )
    safe_globals: list[PyObjectRef] = _key(
        [], "your own item classes, allowed when cached items are loaded (torch.load weights_only=True)"
    )
    stream: StreamConfig | None = _key(
        None, "training data streamed from files and a reader, or from a Hugging Face dataset (docs/data.md)"
    )


def uses_files(data: DataConfig) -> bool:
    """Whether the section describes a file-backed dataset (``files`` given)."""
    return data.files is not None


def check_data(data: DataConfig, raw: RawConfig) -> None:
    """The ``data`` section's values: one source of data, a reader for files, a split summing to 1.

    Raises:
        ConfigError: naming the file, the line and the key.
    """
    section: KeyPath = ("data",)
    defaults = DataConfig()  # a key written with its default value (a saved config) asks for nothing
    given = [k for k in FILE_KEYS if raw.origin.given("data", k) and getattr(data, k) != getattr(defaults, k)]
    if data.stream is not None:
        build = ["build"] if data.build is not None else []
        kwargs = ["kwargs"] if raw.origin.given("data", "kwargs") and data.kwargs else []
        check_stream(data.stream, raw, build + given + kwargs)
        return
    if data.build is not None and given:
        raise raw.origin.error(
            section + (given[0],),
            f"data.build (line {raw.origin.line_of(section + ('build',))}) and data.{given[0]} are both given: "
            f"data.build makes the datasets itself, and "
            f"data.{given[0]} belongs to a file-backed dataset (data.files, data.reader). Keep one of them",
        )
    if data.build is None and not uses_files(data):
        if given:
            raise raw.origin.error(
                section + (given[0],),
                "data.files is missing: the file keys read the files it lists. Add `files: [...]` (zarr stores "
                "or files) and `reader: !pyobject my_module.read`, or give data.build instead",
            )
        raise raw.origin.error(
            section + ("build",),
            "required: set data.build (e.g. `build: !pyobject my_recipe.build`), or data.files and data.reader, "
            "or data.stream",
        )
    if data.build is not None:
        return
    if raw.origin.given("data", "kwargs") and data.kwargs:
        raise raw.origin.error(
            section + ("kwargs",), "is read by data.build only; with data.files, drop it (or give data.build)"
        )
    if not data.files:
        raise raw.origin.error(section + ("files",), "lists no file; name at least one file or zarr store")
    if data.reader is None:
        raise raw.origin.error(
            section + ("reader",) if raw.origin.given("data", "reader") else section + ("files",),
            "data.files needs data.reader: `reader: !pyobject my_module.read_data`, a function "
            "reader(path, index) or QuantumGrav's read_data(store, idx, float_dtype, int_dtype, validate_data)",
        )
    for key in ("n_processes", "chunksize"):
        value = getattr(data, key)
        if value < 1:
            raise raw.origin.error(section + (key,), f"must be >= 1, got {value!r}")
    split = data.split
    if (
        not 2 <= len(split) <= 3
        or any(not math.isfinite(f) or f < 0 for f in split)
        or abs(sum(split) - 1) > 1e-6
    ):
        raise raw.origin.error(
            section + ("split",),
            f"expected 2 or 3 non-negative fractions summing to 1 (train, validation[, test]), got {split!r}; "
            "e.g. `split: [0.8, 0.1, 0.1]`",
        )
    if data.pre_filter is not None and data.output is None:
        raise raw.origin.error(
            section + ("pre_filter",),
            "needs data.output: which samples are kept is decided once, into the cache folder. Set "
            "`output: <folder>`, or drop pre_filter",
        )
