"""The recipe layer: a config turned into a checked plan, and a run built from the plan.

``cli`` parses the command line and calls in here; ``recipe`` is the only part besides
``cli`` that reads a :class:`~unison.config.Config`. A run goes through three phases:

- plan (:func:`plan`, :mod:`unison.recipe.planning.run_plan`): one pass resolves every ``!pyobject`` slot
  and computes every value the run derives (the watched metric, amp, compile and DDP/FSDP
  options, the learning-rate plan, the tracking store, early stopping) into a :class:`RunPlan`;
- preflight (:mod:`unison.recipe.build.preflight`): the plan checked before any rank is spawned
  (the model built on the meta device, the loaders' arguments, the tracking store);
- build (:mod:`unison.recipe.build.assemble`): each rank builds the same objects from the plan and
  attaches the same handlers, one named step at a time.

:func:`run` runs a config from Python, as ``unison run`` does.
"""

from unison.recipe.phases import run
from unison.recipe.planning.run_plan import RunPlan, plan

__all__ = ["RunPlan", "plan", "run"]
