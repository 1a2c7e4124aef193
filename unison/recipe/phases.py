"""``unison run``: a config trained on every rank, then tested; the run's phases, read top to bottom.

In the launching process, :func:`run`::

    config  = load_config(path, overrides)          # read and validated (unison.config)
    planned = plan(config, world_size)              # a closed RunPlan, once (planning/)
    check_before_spawning(planned, resume, ...)     # what only this machine can tell (build/before_spawn)
    launch_config(config, planned, ...)             # spawn the ranks, or be the rank (torchrun, srun)

On every rank, :func:`train_from_config`::

    planned = the launching process's plan          # a spawned rank plans its config once
    run_dir = choose_run_dir(...), held             # new, the job's own, or resumed (folder/)
    parts   = build_run(planned, run_dir)           # the parts, then one attacher per concern (build/)
    resume_run, apply_on_resume                     # the checkpoint, then the plan's values win
    fit                                             # trainer.run
    finish_run or skip_test_phase                   # test set, predictions, hook, metrics.json

A caller's ``attach`` (``unison tune``'s pruning) joins after the build and may say the run ended
before its test phase (a pruned trial).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unison.checkpoint.lock import hold_folder
from unison.config import Config, load_config
from unison.config.main_script import script, use_main
from unison.distributed import barrier, detect_launcher, get_rank, get_world_size, launch
from unison.distributed.fork_server import fork_server_ahead
from unison.engine.empty_epochs import EmptyDataError
from unison.handlers import EXIT_PREEMPTED
from unison.recipe.build.assemble import build_run
from unison.recipe.build.before_spawn import check_before_spawning
from unison.recipe.build.finish import RunContext as RunContext
from unison.recipe.build.finish import evaluate_test_set as evaluate_test_set
from unison.recipe.build.finish import finish_run, skip_test_phase
from unison.recipe.build.finish import write_predictions as write_predictions
from unison.recipe.build.history import RunHistory
from unison.recipe.build.meta_guard import meta_tensors_named
from unison.recipe.build.parts import RunParts, scalar_metrics
from unison.recipe.build.resume_values import apply_on_resume
from unison.recipe.build.stream_data import empty_training_data
from unison.recipe.folder.run_choice import ResumeError as ResumeError
from unison.recipe.folder.run_choice import choose_run_dir, file_logging
from unison.recipe.folder.run_choice import is_run_dir as is_run_dir
from unison.recipe.folder.run_choice import previous_run as previous_run
from unison.recipe.folder.run_folder import RUN_MARKER, resume_command
from unison.recipe.planning.accepted import report_accepted
from unison.recipe.planning.changes import record_changes
from unison.recipe.planning.run_plan import RunPlan, launch_world_size, plan
from unison.utils import get_logger
from unison.utils.logging import console_level
from unison.utils.run_files import write_text
from unison.utils.startup import mark

_log = get_logger("unison.recipe.run")  # the run's logger, shared by the modules of a run

Attach = Callable[[RunParts], Callable[[], str | None] | None]
"""``attach(parts)`` of :func:`train_from_config`: attaches the caller's handlers; it may return
``ended_early()``, asked once training returns: why the run takes no test phase, or None."""


# -- in the launching process ----------------------------------------------------------------


def run(
    config: Config | str | os.PathLike[str],
    *,
    nproc: int | None = None,
    overrides: list[str] | None = None,
    resume: str | None = None,
    main: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Trains what a config describes: spawned locally, or as one rank under torchrun/SLURM.

    The config is read, validated and every ``!pyobject`` resolved here, before any rank
    starts: a mistake fails at once, naming the file, the line and the key.

    Args:
        config: a config file, or a :class:`~unison.config.Config`.
        nproc: ranks to spawn; default ``parallel.nproc_per_node`` (ignored under a
            launcher, which has started the ranks already).
        overrides: ``KEY.PATH=VALUE`` settings, as ``--set`` on the command line.
        resume: ``"auto"`` (the newest run of this config's name with a checkpoint),
            a checkpoint file, or a run directory.
        main: the script ``!pyobject __main__.<name>`` and plain class names (``model.type:
            "GNNModel"``) are looked up in, as ``--main`` on the command line: a ``.py`` file,
            relative to the working directory, imported as ``__mp_main__`` on every rank (its
            ``if __name__ == "__main__":`` block does not run). None: ``__main__`` is the
            script running this call, if it is one.

    Returns:
        Rank 0's results: run directory, final metrics, history (and test metrics).
    """
    mark("run")
    use_main(main)  # this call's script (or none), before the config is read
    if not isinstance(config, Config):
        config = load_config(config, overrides)  # validated: each error names its file and line
    elif overrides:
        raise ValueError("run(overrides=...) applies to a config file; edit the Config object instead.")
    mark("config")
    spawns = detect_launcher().kind == "none" and (nproc or config.parallel.nproc_per_node) is not None
    with fork_server_ahead(spawns) as server_ready:  # what the ranks fork from (spawn.py)
        planned = plan(config, world_size=launch_world_size(config, nproc))  # every value derived once
        mark("plan")
        server_ready()  # forked now where it can be: with the config's modules, which plan imported
        nproc_per_node = _ranks_to_spawn(planned, nproc)
        check_before_spawning(planned, resume, nproc_per_node)
    mark("checks")
    return launch_config(config, planned, resume, nproc_per_node)[0]


def _ranks_to_spawn(planned: RunPlan, nproc: int | None) -> int | None:
    """How many ranks this process spawns (``--nproc``, else ``parallel.nproc_per_node``); None under
    a launcher (this process is one rank) or for one process that trains itself.

    Raises:
        ValueError: ``--nproc`` under torchrun or srun.
    """
    launcher = detect_launcher()
    if launcher.kind == "none":
        return nproc if nproc is not None else planned.launch.nproc_per_node
    if nproc is not None:
        raise ValueError(
            f"--nproc {nproc} was given, but this process is already one rank started by {launcher.describe()}; "
            "leave --nproc out under torchrun or srun."
        )
    return None


def launch_config(
    config: Config,
    planned: RunPlan,
    resume: str | None,
    nproc_per_node: int | None,
    attach: Attach | None = None,
    start_method: str = "forkserver",
    quiet: bool = False,
) -> list[dict[str, Any]]:
    """Runs :func:`train_from_config` on every rank, started with the config's ``parallel`` keys
    (its address and port only when unison spawns the ranks); returns each rank's results.
    ``quiet``: the ranks print errors only (their log files keep everything).

    A rank in this process (``nproc_per_node`` None: torchrun, srun, one process) trains from
    ``planned``, the plan of ``config``; a spawned rank gets ``config`` and plans it once: the plan holds the classes of
    the user's modules and ``--main`` script, which a spawned process can unpickle only after it has
    imported them, and the launch unpickles a rank's arguments before the rank sets anything up."""
    p = planned.launch
    return launch(
        train_from_config,
        planned if nproc_per_node is None else config,
        resume,
        attach,
        quiet,
        script(),  # `--main`: every spawned rank imports the same script
        nproc_per_node=nproc_per_node,
        backend=p.backend,
        timeout=p.timeout,
        master_addr=p.master_addr,
        master_port=p.master_port,
        start_method=start_method,
    )


# -- on every rank ---------------------------------------------------------------------------


def train_from_config(
    config: Config | RunPlan,
    resume: str | None = None,
    attach: Attach | None = None,
    quiet: bool = False,
    main: Path | None = None,
) -> dict[str, Any]:
    """Runs on every rank: builds the run a config describes, trains, tests, and returns results.

    ``attach(parts)``, when given, runs on every rank once the run is built, before it resumes
    and trains: it attaches handlers of the caller's own (``unison tune`` attaches pruning), and
    may return ``ended_early()``: a reason there (the same on every rank) skips the test phase.
    ``quiet`` keeps all but errors off the console; the run's log files keep everything
    (``unison tune`` prints one line per trial). ``main``: the launching process's ``--main``
    script, which ``__main__.<name>`` names here too (:mod:`unison.config.main_script`).

    Distributed:
        Call it on every rank (``launch`` does): it is full of collectives.
    """
    if main is not None:
        use_main(main)  # a spawned rank: the launching process's script
    given = config.log_level
    level = None if given is None else logging.getLevelName(given)  # log_level, every rank
    with console_level(logging.ERROR if quiet else level):
        # A process plans once: the plan it was given, or (a spawned rank) its own of the same config.
        planned = config if isinstance(config, RunPlan) else plan(config)
        return _in_run_folder(planned, resume, attach)


def _in_run_folder(planned: RunPlan, resume: str | None, attach: Attach | None) -> dict[str, Any]:
    """:func:`train_from_config` inside the run folder it picks and holds, logging to its files."""
    mark("rank_plan")  # UNISON_STARTUP_TRACE (unison.utils.startup): a line per phase, when set
    run_dir, resume_from = choose_run_dir(planned.run_root, resume)
    with hold_folder(run_dir):  # one job per run folder (unison.checkpoint.lock): refused on every rank
        _open_run_folder(planned, run_dir, resume_from)
        log_file = file_logging(run_dir)
        mark("run_folder")
        try:
            return _train(planned, run_dir, resume_from, attach)
        except SystemExit as stop:
            if stop.code == EXIT_PREEMPTED and get_rank() == 0:  # saved at an agreed iteration
                command = resume_command(planned.refs.origin, run_dir, script())
                _log.warning("preempted; to continue this run: %s", command)
            raise
        finally:
            logging.getLogger("unison").removeHandler(log_file)
            log_file.close()


def _open_run_folder(planned: RunPlan, run_dir: Path, resume_from: str | None) -> None:
    """Rank 0 marks the run folder, records what changed since the run it resumes, and writes the
    config it runs (URL credentials masked); every rank waits for it."""
    if get_rank() == 0:
        write_text(run_dir / RUN_MARKER, "", "a")  # no file here follows a link (unison.utils.run_files)
        if resume_from is not None:
            record_changes(planned.record, planned.refs.origin, run_dir, planned.resolved.scheduler_type)
        if planned.record_yaml is None:
            raise ValueError(
                "this config holds an object where a reference belongs (a config built in Python), and a "
                "run writes its config.yaml: name the object with PyObjectRef('module.name') instead"
            )
        write_text(run_dir / "config.yaml", planned.record_yaml)
    barrier()  # the folder exists before any rank writes into it


def _train(
    plan: RunPlan, run_dir: Path, resume_from: str | None, attach: Attach | None = None
) -> dict[str, Any]:
    """A rank's phases: build, resume, train, then test and write the results."""
    world = get_world_size()
    _log.info("run directory: %s (world size %d)", run_dir, world)
    report_accepted(plan.accepted)  # keys of other trainers' configs that are not needed here, once
    parts = build_run(plan, run_dir, world)
    ended_early = attach(parts) if attach is not None else None
    resumed = apply_on_resume(plan, parts, resume_run(parts, resume_from))  # the config's values win
    if resumed is not None and parts.trainer.is_complete(plan.trainer.max_epochs):
        return _complete(parts, run_dir, world, plan.trainer.max_epochs)
    fit(plan, parts)
    results = collect_results(parts, run_dir, world)
    why = ended_early() if ended_early is not None else None
    if why is not None:  # a pruned trial: its test set is not the sweep's to measure
        skip_test_phase(run_dir, results, why)
    else:
        finish_run(plan, parts, run_dir, results)
    return results


def resume_run(parts: RunParts, resume_from: str | None) -> Path | None:
    """Resume: loads ``resume_from`` (``"auto"`` or a checkpoint file) into the parts.

    Nothing happens without a checkpoint handler or without ``resume_from``.

    Returns:
        The checkpoint file resumed from, or None for a fresh start.

    Distributed:
        Collective: call on every rank, before ``parts.trainer.run``.
    """
    if parts.checkpoint is None or resume_from is None:
        return None
    return parts.checkpoint.resume(resume_from)


def fit(plan: RunPlan, parts: RunParts) -> None:
    """Trains: ``parts.trainer.run`` over the training data for ``training.max_epochs``.

    Raises:
        ConfigError: the training data yielded no batch in an epoch on any rank, at its key.

    Distributed:
        Collective: call on every rank.
    """
    t = plan.trainer
    try:
        with meta_tensors_named(parts.trainer):  # a meta tensor the user's code kept, named with its cause
            parts.trainer.run(parts.train_loader, max_epochs=t.max_epochs, epoch_length=t.epoch_length)
    except EmptyDataError as err:  # an evaluator's own is not the training data's
        if err.engine_name != parts.trainer.name:
            raise
        raise empty_training_data(plan, err) from None


def _complete(parts: RunParts, run_dir: Path, world: int, max_epochs: int) -> dict[str, Any]:
    """The results of a resumed run that had trained all its epochs: nothing trained, nothing written."""
    _log.info(
        "the run in %s is complete (epoch %d of %d): nothing to do, nothing written. Set a larger "
        "training.max_epochs to train further.",
        run_dir, parts.trainer.state.epoch, max_epochs,
    )  # fmt: skip
    RunHistory(run_dir, parts.history).restore(
        parts.trainer.state.epoch
    )  # the run's rows, as metrics.json has
    return {**collect_results(parts, run_dir, world), "complete": True}


def collect_results(parts: RunParts, run_dir: Path, world_size: int) -> dict[str, Any]:
    """The results of training: counters, final training loss and validation metrics, history."""
    trainer, evaluator = parts.trainer, parts.evaluator
    return {
        "run_dir": str(run_dir),
        "world_size": world_size,
        "epochs": trainer.state.epoch,
        "iterations": trainer.state.iteration,
        "train_loss": trainer.state.metrics.get("loss"),
        "validation": scalar_metrics(evaluator.state.metrics),
        "history": parts.history,
    }
