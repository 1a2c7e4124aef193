"""The guard of handlers built for one trainer: attached to another engine, they refuse it."""

from __future__ import annotations

from ignite.engine import Engine


def _named(engine: Engine) -> str:
    name = getattr(engine, "name", None)
    return f"the engine {name!r}" if isinstance(name, str) else f"a {type(engine).__name__}"


def own_trainer(who: str, trainer: Engine, engine: Engine | None, *, evaluators: bool = False) -> Engine:
    """The engine a handler built for ``trainer`` attaches to: ``trainer``, which ``engine``
    must be when given (``who``: the handler's class, for the error; ``evaluators``: it takes
    evaluators in its constructor, and the fix says so).

    Raises:
        ValueError: naming the handler, the engine it got, its trainer and the fix.
    """
    if engine is None or engine is trainer:
        return trainer
    fix = f"attach it to the trainer given as {who}(trainer=...), or call {who}.attach() alone"
    if evaluators:
        fix += f"; evaluators go to the constructor: {who}(..., evaluators={{'val': evaluator}})"
    raise ValueError(
        f"{who}.attach(engine) got {_named(engine)}, not its trainer ({_named(trainer)}): {fix}."
    )
