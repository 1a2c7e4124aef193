"""Rank functions of tests/distributed/test_ddp_resume.py.

A small MLP trained with Adam on batches that depend only on (iteration, rank), so a run
stopped after ``k`` iterations and resumed from its saved ``state_dict``s must end with
the uninterrupted run's parameters, bit for bit. ``wrap="unison"`` wraps with
``prepare_model``; ``wrap="torch"`` with a plain ``DistributedDataParallel`` (the
reference the fix is measured against).
"""

from __future__ import annotations

import io
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from unison.distributed import get_rank, is_distributed, prepare_model, unwrap_model

BATCH = 4
IN, HIDDEN, OUT = 8, 16, 3


def make_mlp(seed: int = 0, widths: tuple[int, ...] = (IN, HIDDEN, HIDDEN, OUT)) -> nn.Module:
    """A few Linear layers with biases and no dropout, initialised from ``seed``."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.Tanh())
    model = nn.Sequential(*layers)
    torch.random.set_rng_state(gen_state)
    return model


def batch(
    iteration: int, rank: int, in_features: int = IN, out: int = OUT
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of ``iteration``: a function of both, not of any RNG state."""
    gen = torch.Generator().manual_seed(1000 * iteration + rank)
    return torch.randn(BATCH, in_features, generator=gen), torch.randint(0, out, (BATCH,), generator=gen)


def wrap_model(model: nn.Module, wrap: str, **ddp_kwargs: Any) -> nn.Module:
    """``prepare_model`` (``"unison"``) or a plain DDP wrap (``"torch"``, several ranks only)."""
    if wrap == "unison":
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # FixedBucketsDDP's fallback warning
            return prepare_model(model, **ddp_kwargs)
    if wrap == "torch" and is_distributed():
        return DistributedDataParallel(model, **ddp_kwargs)
    if wrap == "torch":
        return model
    raise ValueError(wrap)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, start: int, stop: int) -> None:
    """Iterations ``start .. stop - 1``."""
    loss_fn = nn.CrossEntropyLoss()
    rank = get_rank()
    for it in range(start, stop):
        x, y = batch(it, rank)
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()


def fresh(wrap: str, **ddp_kwargs: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = wrap_model(make_mlp(), wrap, **ddp_kwargs)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in unwrap_model(model).parameters()])


def to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def resume_gaps(total: int, stops: list[int], wrap: str, **ddp_kwargs: Any) -> dict[int, float]:
    """Max |resumed - uninterrupted| over the parameters, for each resume point in ``stops``.

    Each resumed run is a fresh model and a fresh DDP wrap (a new Reducer) in the same
    process group, loaded from ``state_dict``s that went through ``torch.save``.
    """
    model, optimizer = fresh(wrap, **ddp_kwargs)
    train(model, optimizer, 0, total)
    truth = flat_params(model)
    gaps: dict[int, float] = {}
    for stop in stops:
        model, optimizer = fresh(wrap, **ddp_kwargs)
        train(model, optimizer, 0, stop)
        saved = to_bytes({"model": unwrap_model(model).state_dict(), "optimizer": optimizer.state_dict()})
        del model, optimizer
        model, optimizer = fresh(wrap, **ddp_kwargs)
        state = from_bytes(saved)
        unwrap_model(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        train(model, optimizer, stop, total)
        gaps[stop] = (flat_params(model) - truth).abs().max().item()
    return gaps


def train_and_save(total: int, stop: int, wrap: str, path: str) -> bytes:
    """First process group: the uninterrupted run's parameters; saves the run stopped at ``stop``."""
    model, optimizer = fresh(wrap)
    train(model, optimizer, 0, total)
    truth = flat_params(model)
    model, optimizer = fresh(wrap)
    train(model, optimizer, 0, stop)
    if get_rank() == 0:
        torch.save({"model": unwrap_model(model).state_dict(), "optimizer": optimizer.state_dict()}, path)
    if is_distributed():
        dist.barrier()
    return to_bytes(truth)


def load_and_finish(total: int, stop: int, wrap: str, path: str) -> bytes:
    """Second, fresh process group: loads the saved run and trains to ``total``."""
    model, optimizer = fresh(wrap)
    state = torch.load(path, weights_only=True, map_location="cpu")
    unwrap_model(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    train(model, optimizer, stop, total)
    return to_bytes(flat_params(model))


def final_params(total: int, wraps: list[str]) -> dict[str, bytes]:
    """For each wrap, the parameters after ``total`` uninterrupted iterations."""
    result = {}
    for wrap in wraps:
        model, optimizer = fresh(wrap)
        train(model, optimizer, 0, total)
        result[wrap] = to_bytes(flat_params(model))
    return result


# --- bucket layouts -------------------------------------------------------------------------------


def layout(model: nn.Module) -> list[list[int]]:
    """The Reducer's buckets now, as lists of indices into ``unwrap_model(model).parameters()``."""
    assert isinstance(model, DistributedDataParallel)
    index = {id(p): i for i, p in enumerate(unwrap_model(model).parameters())}
    return [
        [index[id(p)] for p in bucket.parameters()] for bucket in model.reducer._get_zeros_like_grad_buckets()
    ]


def layouts(
    wrap: str, widths: tuple[int, ...] = (IN, HIDDEN, HIDDEN, OUT), iterations: int = 3, **ddp_kwargs: Any
) -> dict:
    """The bucket layout of a fresh wrap, then after each of ``iterations`` training steps."""
    model = wrap_model(make_mlp(widths=widths), wrap, **ddp_kwargs)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    seen = [layout(model)]
    at_wrap = model._get_ddp_logging_data()
    loss_fn = nn.CrossEntropyLoss()
    for it in range(iterations):
        x, y = batch(it, get_rank(), widths[0], widths[-1])
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
        seen.append(layout(model))
    data = model._get_ddp_logging_data()
    return {
        "layouts": seen,
        "logging": {k: v for k, v in data.items() if "bucket" in k or "rebuilt" in k},
        "logging_at_wrap": {k: v for k, v in at_wrap.items() if "bucket" in k or "rebuilt" in k},
        "has_rebuilt": model._has_rebuilt_buckets,
        "type": type(model).__name__,
    }


def layouts_of_both(widths_list: list[tuple[int, ...]]) -> dict:
    """:func:`layouts` of stock DDP and of ``prepare_model``, for each model width."""
    return {widths: {wrap: layouts(wrap, widths) for wrap in ("torch", "unison")} for widths in widths_list}


def wrapper_types() -> dict[str, str]:
    """The class ``prepare_model`` wraps with, for a few DDP settings."""
    default = prepare_model(make_mlp())
    return {
        "default": type(default).__name__,
        "find_unused_parameters": type(prepare_model(make_mlp(), find_unused_parameters=True)).__name__,
        "find_unused_parameters+static_graph": type(
            prepare_model(make_mlp(), find_unused_parameters=True, static_graph=True)
        ).__name__,
        "unwrap_model": type(unwrap_model(default)).__name__,
    }


def iteration_times(widths: tuple[int, ...], iterations: int, repeats: int) -> dict[str, Any]:
    """Seconds per training iteration of stock DDP and ``prepare_model``, interleaved repeats.

    Not a test: the measurement behind the cost figure in ``unison/distributed/ddp_buckets.py``.
    """
    models: dict[str, nn.Module] = {}
    wrap_seconds: dict[str, float] = {}
    for wrap in ("torch", "unison"):
        start = time.perf_counter()
        models[wrap] = wrap_model(make_mlp(widths=widths), wrap)
        wrap_seconds[wrap] = time.perf_counter() - start
    optimizers = {w: torch.optim.SGD(m.parameters(), lr=1e-3) for w, m in models.items()}
    loss_fn = nn.CrossEntropyLoss()
    x, y = batch(0, get_rank(), widths[0], widths[-1])
    x, y = x.repeat(16, 1), y.repeat(16)
    times: dict[str, list[float]] = {w: [] for w in models}
    for r in range(repeats + 1):
        for wrap in ("torch", "unison") if r % 2 else ("unison", "torch"):
            model, optimizer = models[wrap], optimizers[wrap]
            start = time.perf_counter()
            for _ in range(iterations):
                optimizer.zero_grad()
                loss_fn(model(x), y).backward()
                optimizer.step()
            if r:
                times[wrap].append((time.perf_counter() - start) / iterations)
    return {"times": times, "wrap_seconds": wrap_seconds}
