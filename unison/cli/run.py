"""``unison.cli.run``: where :func:`unison.recipe.run` was first published; the same functions.

The recipe layer (:mod:`unison.recipe`) turns a config into a checked run and trains it;
this module keeps the older import path working.
"""

from unison.recipe.runner import ResumeError, is_run_dir, previous_run, run, train_from_config

__all__ = ["ResumeError", "is_run_dir", "previous_run", "run", "train_from_config"]
