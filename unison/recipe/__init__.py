"""The recipe layer: a config turned into checked objects, and a run built from them.

``cli`` parses the command line and calls in here; ``recipe`` is the only part besides
``cli`` that reads a :class:`~unison.config.Config`. A run goes through three phases:

- resolve (:mod:`unison.recipe.resolve`): every ``!pyobject`` slot imported and checked,
  in the launching process;
- preflight (:mod:`unison.recipe.preflight`): the whole run checked before any rank is
  spawned (the model built on the meta device, the loaders' arguments, the tracking store);
- build (:mod:`unison.recipe.steps`): each rank builds the same objects and attaches the same
  handlers, one named step at a time.

:func:`run` runs a config from Python, as ``unison run`` does.
"""

from unison.recipe.run import run

__all__ = ["run"]
