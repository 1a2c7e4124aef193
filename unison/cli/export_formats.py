"""The file formats of ``unison export``: ``pt`` (``torch.save``) and ``safetensors``.

A safetensors file holds tensors and a ``dict[str, str]`` of metadata, and loads without
unpickling anything. ``unison export --format safetensors`` writes the weights with the
plain model's keys and these metadata strings:

- ``format``: ``"pt"`` (the tensors are torch's, as tools that read the header expect);
- ``unison.checkpoint``: JSON of the exported checkpoint's epoch, iteration, score and metric;
- ``unison.config``: the run's ``config.yaml`` as written, URL credentials masked;
- ``unison.metrics``: the run's ``metrics.json`` (the final validation and test metrics and
  the history), as JSON, when the run has finished and written it;
- ``unison.tied``: JSON ``{dropped name: kept name}`` for tied weights, when there are any.

``config.yaml`` and ``metrics.json`` are read as a run folder's files are
(:mod:`unison.utils.run_files`): regular files only, without following a link, at most
:data:`MAX_CONFIG` and :data:`MAX_METRICS` bytes. A run folder from elsewhere whose
``config.yaml`` links to ``/proc/self/environ`` or a token file is refused, naming the entry,
instead of embedding what it points to in the model file.

safetensors refuses two names over one storage. Tied weights (an embedding shared with an
output layer: two keys, one tensor) are stored once, under the first name in sorted order,
the same choice ``safetensors.torch.save_model`` makes, so ``safetensors.torch.load_model``
loads the file into the model and ties them back; ``load_file`` followed by
``model.load_state_dict(state, strict=False)`` does too (loading one name fills both).
Tensors that share a storage without being the same tensor (views of different parts) are
each written whole, as copies.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from unison.checkpoint.io import _atomic_write
from unison.utils.run_files import RunFileError, read_text
from unison.utils.secrets import redact, redact_url

FORMATS = ("pt", "safetensors")
"""What ``unison export --format`` writes; ``pt`` is the default."""

SUFFIXES = {"pt": ".pt", "safetensors": ".safetensors"}

MAX_CONFIG = 4 * 2**20
"""The most bytes of ``config.yaml`` an export reads (a config is a few KiB)."""

MAX_METRICS = 16 * 2**20
"""The most bytes of ``metrics.json`` an export reads (the history of a long run fits)."""

INSTALL = "pip install 'unison[export]' (or pip install safetensors)"


class FormatError(ValueError):
    """Weights that the asked format cannot hold, a format whose package is missing, or a run file
    that is not embedded (a link, a special file, too large)."""


def untied(weights: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of ``weights`` with no two sharing a storage, and ``{dropped: kept}`` for tied names.

    Example:
        >>> w = torch.ones(2, 2)
        >>> tensors, tied = untied({"head.weight": w, "embed.weight": w, "bias": torch.zeros(2)})
        >>> sorted(tensors), tied
        (['bias', 'embed.weight'], {'head.weight': 'embed.weight'})

    Raises:
        FormatError: for a value that is not a tensor, naming its key.
    """
    others = sorted(key for key, value in weights.items() if not isinstance(value, torch.Tensor))
    if others:
        raise FormatError(
            f"--format safetensors: {others} are not tensors ({type(weights[others[0]]).__name__}); safetensors "
            "holds tensors only. Export with --format pt."
        )
    groups: dict[tuple[Any, ...], list[str]] = {}
    for key in sorted(weights):
        tensor = weights[key]
        storage = tensor.untyped_storage()
        groups.setdefault((tensor.device, storage.data_ptr(), storage.nbytes()), []).append(key)
    tensors: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    for keys in groups.values():
        first = weights[keys[0]]
        if len(keys) > 1 and all(_same_view(weights[key], first) for key in keys):
            tensors[keys[0]] = first.detach().contiguous()
            tied.update({key: keys[0] for key in keys[1:]})
            continue
        for key in keys:  # alone, or views of different parts: each written whole
            tensor = weights[key].detach()
            tensors[key] = (
                tensor.clone(memory_format=torch.contiguous_format) if len(keys) > 1 else tensor.contiguous()
            )
    return {key: tensors[key] for key in sorted(tensors)}, tied


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def run_metadata(run: Path, meta: Mapping[str, Any]) -> dict[str, str]:
    """The metadata strings of an export of ``run`` (see the module's notes); ``meta`` is the checkpoint's.

    Raises:
        FormatError: ``config.yaml`` or ``metrics.json`` is a link, not a regular file, or too
            large (naming it and the fix).
    """
    checkpoint = {key: meta.get(key) for key in ("epoch", "iteration", "score", "metric") if key in meta}
    out = {"format": "pt", "unison.checkpoint": json.dumps(checkpoint, sort_keys=True)}
    config = _run_file(run / "config.yaml", MAX_CONFIG)
    if config is not None:
        out["unison.config"] = redact_url(config)
    metrics = _run_file(run / "metrics.json", MAX_METRICS)
    if metrics is not None:
        try:
            out["unison.metrics"] = json.dumps(redact(json.loads(metrics)), sort_keys=True)
        except ValueError:
            pass  # a run writing it right now: the weights still export
    return out


def _run_file(path: Path, limit: int) -> str | None:
    """The text of a run folder's file, read in place (never through a link); None when absent."""
    if not os.path.lexists(path):
        return None
    try:
        return read_text(path, limit)
    except RunFileError as err:
        raise FormatError(f"{err} (unison export embeds this file in the model file's metadata)") from None
    except (OSError, UnicodeDecodeError):
        return None  # unreadable (a run writing it right now): the weights still export


def save_safetensors(
    weights: Mapping[str, Any], target: Path, metadata: Mapping[str, str]
) -> dict[str, torch.Tensor]:
    """Writes ``weights`` (tied names stored once) and ``metadata`` to ``target`` as safetensors, atomically;
    returns the tensors written.

    Raises:
        FormatError: safetensors is not installed (naming the install line), or a value is not a tensor.
    """
    try:
        from safetensors.torch import save
    except ImportError as err:
        raise FormatError(
            f"--format safetensors needs the safetensors package, which is not installed: {INSTALL}."
        ) from err
    tensors, tied = untied(weights)
    header = dict(metadata)
    if tied:
        header["unison.tied"] = json.dumps(tied, sort_keys=True)
    tensors = {key: tensor.cpu() for key, tensor in tensors.items()}
    payload = save(tensors, metadata=header)
    _atomic_write(target, lambda fh: fh.write(payload))
    return tensors
