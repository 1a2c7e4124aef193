"""How one config's references resolve, and the errors that point into it.

:class:`_References` holds a config's scope (its ``imports:``, its folder) and its
:class:`~unison.config.Origin` (file, lines, ``--set`` overrides): it looks up a
``!pyobject`` against its slot, resolves a kwargs mapping, makes a
:class:`~unison.config.ConfigError` at a dotted key path through the origin's one
locator, and checks that a kwargs mapping binds to the signature it will be called with.
Used by :mod:`unison.recipe.planning.resolved` and :mod:`unison.recipe.build.preflight`.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unison.config import Config, ConfigError, Origin, resolve_tree
from unison.config.resolve import Scope, lookup
from unison.config.usercode import describe, refused_import


@dataclass(frozen=True)
class _References:
    """How one config's references resolve: its imports, its folder, and its lines for errors."""

    origin: Origin
    scope: Scope

    @classmethod
    def of(cls, config: Config) -> _References:
        """The references of ``config``; refuses an ``imports:`` entry that is not the user's own code."""
        source = config.origin.file
        config_dir = Path(source).parent if source else None
        refs = cls(config.origin, Scope(tuple(config.imports), config_dir))
        for i, entry in enumerate(config.imports):
            why = refused_import(entry, config_dir)
            if why is not None:
                raise refs.error(f"imports.{i}", f"{entry!r} is refused: {why}")
        return refs

    def ref(self, value: Any, slot: str, key: str) -> Any:
        """The object ``value`` names, checked to fit ``slot``, for the key path ``key``."""
        return lookup(value, slot=slot, key=key, scope=self.scope)[0]

    def tree(self, value: Any, key: str, slot: str | None = None) -> dict[str, Any]:
        """The kwargs mapping ``value`` with every reference in it resolved as a value (of ``slot``:
        ``model_arg`` admits the layer classes and nn functions of installed libraries too)."""
        if not isinstance(value, dict):
            raise self.error(key, f"expected a mapping of keyword arguments, got {type(value).__name__}")
        for name in value:
            if not isinstance(name, str) or not name.isidentifier():
                raise self.error(
                    f"{key}.{name}",
                    f"a keyword argument's name is a word, got {type(name).__name__} {name!r}; quote it or rename it",
                )
        extra = {} if slot is None else {"slot": slot}
        return dict(
            resolve_tree(
                value, key=key, imports=self.scope.imports, config_dir=self.scope.config_dir, **extra
            )
        )

    def error(self, key: str, message: str) -> ConfigError:
        """A config error at the dotted key path ``key``, with its file and line (or its ``--set``)."""
        return self.origin.error(tuple(key.split(".")), message)

    def bind(
        self,
        fn: Any,
        *,
        type_key: str,
        kwargs_key: str,
        kwargs: dict[str, Any],
        args: tuple[Any, ...] = (),
        supplied: dict[str, Any] | None = None,
        how: str = "",
    ) -> None:
        """Checks ``fn(*args, **supplied, **kwargs)`` binds, naming the kwargs key that does not.

        ``args`` and ``supplied`` are what unison passes itself (the parameters, the
        optimizer, the seed ...); ``how`` says so in messages.
        """
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # a built-in without a signature: nothing to check
            return
        supplied = dict(supplied or {})
        try:
            signature.bind(*args, **supplied, **kwargs)
            return
        except TypeError as err:
            problem = str(err)
        params = signature.parameters
        named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        what = describe(fn)
        if not takes_any:
            for name in kwargs:
                if name not in named:
                    near = difflib.get_close_matches(name, named, n=1, cutoff=0.6)
                    hint = f" Did you mean {near[0]!r}?" if near else ""
                    raise self.error(
                        f"{kwargs_key}.{name}",
                        f"{what} takes no argument {name!r}; it takes {', '.join(named) or 'none'}.{hint}",
                    )
        missing = problem.partition("missing a required argument: ")[2]
        if missing:
            raise self.error(type_key, f"{what}{how} needs the argument {missing}; add it under {kwargs_key}")
        key = kwargs_key if kwargs else type_key
        raise self.error(key, f"{what}{how} cannot be called with {kwargs_key} = {kwargs}: {problem}")
