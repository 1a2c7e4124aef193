"""A model's units: the submodules FSDP2 shards one at a time and activation checkpointing wraps.

``"auto"`` takes the repeated blocks: every class with two or more instances that hold
parameters and run a forward of their own, outermost first (transformer layers, residual
blocks, the layers of an MLP). A container that only holds modules (``nn.ModuleList``,
``nn.ModuleDict``) is never a unit: its ``forward`` never runs, and FSDP2 gathers a unit's
parameters as its forward starts (``fully_shard`` refuses one); the modules inside it are
looked at instead. A list of class names takes the submodules of those classes.

Tied weights (a language model's output projection that is its embedding, blocks sharing
a layer): FSDP2 shards a parameter within one unit only, so a chosen unit holding a
parameter that a module outside it uses too is not made a unit; its parameters stay with
the root, the unit that holds every module using them (:func:`untied_units`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

__all__ = [
    "auto_units",
    "candidates",
    "check_named",
    "named_units",
    "outermost",
    "runs_forward",
    "untied_units",
]


def auto_units(model: nn.Module) -> list[nn.Module]:
    """The submodules the ``"auto"`` rule shards as units, outermost first (the root excluded).

    Every class with two or more instances that hold parameters is a block class; an
    instance becomes a unit unless it sits inside another unit.

    Example:
        >>> m = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> [type(u).__name__ for u in auto_units(m)]
        ['Linear', 'Linear']
    """
    counts: dict[type, int] = {}
    for module in model.modules():
        if module is not model and runs_forward(module) and any(True for _ in module.parameters()):
            counts[type(module)] = counts.get(type(module), 0) + 1
    blocks = {cls for cls, n in counts.items() if n >= 2}
    return outermost(model, lambda m: type(m) in blocks)


def runs_forward(module: nn.Module) -> bool:
    """Whether ``module``'s class has a ``forward`` of its own: FSDP2 gathers a unit's parameters
    as its forward starts, so a container that only holds modules (``nn.ModuleList``,
    ``nn.ModuleDict``, whose ``forward`` is never called) cannot be a unit; its modules can.

    Example:
        >>> runs_forward(nn.Linear(2, 2)), runs_forward(nn.ModuleList([nn.Linear(2, 2)]))
        (True, False)
    """
    return type(module).forward is not nn.Module.forward


def named_units(model: nn.Module, names: Sequence[str], who: str = "parallel.fsdp.shard") -> list[nn.Module]:
    """The submodules whose class name is in ``names``, outermost first.

    Raises:
        ValueError: naming ``who`` (the rule's key), for a name that matches no submodule or one
            of a container without a forward (:func:`check_named`).
    """
    wanted = set(names)
    check_named(model, wanted, who)
    return outermost(model, lambda m: type(m).__name__ in wanted)


def candidates(model: nn.Module) -> list[str]:
    """The classes of ``model``'s submodules that hold parameters: what a rule may name."""
    return sorted(
        {type(m).__name__ for m in model.modules() if m is not model and any(True for _ in m.parameters())}
    )


def check_named(model: nn.Module, names: set[str], who: str) -> None:
    """Raises ``ValueError`` when ``names`` (the class names a rule names, ``who`` its key) name a class
    ``model`` does not hold, or one that only holds modules: its ``forward`` never runs, so it can
    be neither an FSDP2 unit nor a block to recompute. Each message names what to use instead."""
    missing = sorted(names - {type(m).__name__ for m in model.modules() if m is not model})
    if missing:
        raise ValueError(
            f"{who} names {missing}, which the model ({type(model).__name__}) does not contain; the classes that "
            f"could be meant (they hold parameters) are {candidates(model)}. Use some of those, or 'auto'."
        )
    holders = sorted(
        {type(m).__name__ for m in model.modules() if m is not model and not runs_forward(m)} & names
    )
    if not holders:
        return
    inside = sorted(
        {
            type(child).__name__
            for m in model.modules()
            if type(m).__name__ in holders
            for child in m.children()
            if runs_forward(child)
        }
    )
    raise ValueError(
        f"{who} names {holders}, which only hold modules (no forward of their own runs, and a unit's work "
        f"starts in its forward); name the classes inside them instead: {inside}, or use 'auto'."
    )


def outermost(model: nn.Module, chosen: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """The submodules ``chosen`` takes that hold parameters, outermost first: none inside another."""
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if chosen(child) and any(True for _ in child.parameters()):
                units.append(child)
            else:
                visit(child)

    visit(model)
    return units


def untied_units(
    model: nn.Module, units: Sequence[nn.Module]
) -> tuple[list[nn.Module], dict[str, list[str]]]:
    """``units`` without those that share a parameter with a module outside them, and the ties.

    A unit whose parameter is also used by another unit or by the root's own modules is
    left to the root; so is, in turn, any unit that shares a parameter with what the root
    took. ``units`` are disjoint (outermost). Returns the units kept, in order, and each
    tied parameter that crosses a unit's border: its first name -> its other names.

    Example:
        >>> m = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 4), nn.Linear(4, 5, bias=False))
        >>> m[2].weight = m[0].weight
        >>> kept, ties = untied_units(m, [m[1], m[2]])
        >>> kept == [m[1]], ties
        (True, {'0.weight': ['2.weight']})
    """
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    tied = {key: found for key, found in names.items() if len(found) > 1}
    kept = list(units)
    crossing: set[int] = set()
    while True:
        owners: dict[int, set[int]] = {}  # a tied parameter -> the units using it (-1: the root)
        for i, unit in enumerate(kept):
            for param in unit.parameters():
                owners.setdefault(id(param), set()).add(i)
        for param in _root_parameters(model, {id(unit) for unit in kept}):
            owners.setdefault(id(param), set()).add(-1)
        shared = {key for key, users in owners.items() if key in tied and len(users) > 1}
        dropped = {i for key in shared for i in owners[key] if i >= 0}
        crossing |= shared
        if not dropped:
            return kept, {
                names[key][0]: names[key][1:] for key in sorted(crossing, key=lambda k: names[k][0])
            }
        kept = [unit for i, unit in enumerate(kept) if i not in dropped]


def _root_parameters(model: nn.Module, units: set[int]) -> list[nn.Parameter]:
    """The parameters of the modules reached from ``model`` without entering one of ``units``."""
    found: list[nn.Parameter] = []
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        seen.add(id(module))
        found.extend(p for p in module._parameters.values() if p is not None)
        for child in module.children():
            if id(child) not in units and id(child) not in seen:
                visit(child)

    visit(model)
    return found
