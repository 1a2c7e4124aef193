"""The Engine's own cost per iteration, counted exactly: Python calls (and builtin calls)
per training iteration over a raw loop, against ignite's Engine in the same process.

Counted with ``sys.setprofile`` as the difference between a run of 2n and a run of n
iterations, so each run's fixed cost cancels out: deterministic to the call, unlike a timing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from ignite.engine import Engine as IgniteEngine

from unison.engine import Engine

N = 100


def _calls(run: Callable[[int], None], n: int) -> int:
    count = 0

    def profile(frame, event, arg) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        run(n)
    finally:
        sys.setprofile(None)
    return count


def _per_iteration(run: Callable[[int], None]) -> float:
    run(20)  # warm caches and lazy imports
    return (_calls(run, 2 * N) - _calls(run, N)) / N


def _workload() -> tuple[Callable[[object], torch.Tensor], list]:
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(1, 16), torch.randn(1, 1)) for _ in range(2 * N)]

    def step(batch: object) -> torch.Tensor:
        x, y = batch  # type: ignore[misc]  # a pair
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    return step, data


def test_the_engine_costs_at_most_half_of_ignites_calls_per_iteration() -> None:
    step, data = _workload()

    def raw(n: int) -> None:
        for batch in data[:n]:
            step(batch)

    def engine_of(cls: type) -> Callable[[int], None]:
        def run(n: int) -> None:
            cls(lambda engine, batch: step(batch)).run(data[:n], max_epochs=1)

        return run

    base = _per_iteration(raw)
    ignite_over = _per_iteration(engine_of(IgniteEngine)) - base
    unison_over = _per_iteration(engine_of(Engine)) - base
    assert ignite_over > 0
    assert unison_over <= ignite_over / 2, (
        f"unison's Engine adds {unison_over:g} calls per iteration over a raw loop, ignite's {ignite_over:g}: "
        "the budget is half of ignite's (docs/benchmarks.md)"
    )
