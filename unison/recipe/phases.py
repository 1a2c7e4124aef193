"""``unison run``: a validated config, trained on every rank, then tested; the run's phases.

A run takes three phases, one module each:

- plan (:mod:`unison.recipe.planning.run_plan`): everything a config names is imported and type-checked,
  and every value the run derives is computed once, into a
  :class:`~unison.recipe.planning.run_plan.RunPlan`; :func:`~unison.recipe.build.preflight.preflight` checks it
  in the launching process, before any rank is spawned;
- build (:mod:`unison.recipe.build.assemble`): each rank builds the same objects from the plan and
  attaches the same handlers, one named step at a time, into a
  :class:`~unison.recipe.build.parts.RunParts` (:func:`~unison.recipe.build.assemble.build_run`): data, model,
  optimizer and scheduler, trainer, evaluator, handlers;
- run (this module): :func:`run` launches the ranks; each runs :func:`train_from_config`, which
  plans again (the objects a config names do not travel between processes), picks the run
  directory and its log files, builds the run, resumes it
  (:func:`resume_run`), trains, collects the results (:func:`collect_results`) and takes
  the test phase (:func:`~unison.recipe.build.finish.finish_run`: test set, predictions, the
  recipe's hook, ``metrics.json``), unless the caller's ``attach`` says the run ended before
  it (a pruned trial of a sweep).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unison.checkpoint.lock import hold_folder
from unison.config import Config, load_config
from unison.config.main_script import script, use_main
from unison.distributed import (
    barrier,
    broadcast_object,
    detect_launcher,
    get_rank,
    get_world_size,
    launch,
)
from unison.distributed.spawn import start_fork_server
from unison.engine.empty_epochs import EmptyDataError
from unison.handlers import EXIT_PREEMPTED
from unison.recipe.build.assemble import build_run
from unison.recipe.build.finish import RunContext as RunContext
from unison.recipe.build.finish import evaluate_test_set as evaluate_test_set
from unison.recipe.build.finish import finish_run, skip_test_phase
from unison.recipe.build.finish import write_predictions as write_predictions
from unison.recipe.build.history import RunHistory
from unison.recipe.build.meta_guard import meta_tensors_named
from unison.recipe.build.parts import RunParts, scalar_metrics
from unison.recipe.build.preflight import check_port, preflight
from unison.recipe.build.resume_shape import check_resume_shape
from unison.recipe.build.resume_values import apply_on_resume
from unison.recipe.build.stream_data import empty_training_data
from unison.recipe.folder.job_run import job_previous_run, new_job_run, run_job
from unison.recipe.folder.run_folder import (
    RUN_MARKER,
    new_run_folder,
    refuse_if_held,
    refuse_unsafe,
    resume_command,
)
from unison.recipe.planning.accepted import report_accepted
from unison.recipe.planning.changes import check_resume, record_changes
from unison.recipe.planning.run_plan import RunPlan, launch_world_size, plan
from unison.utils import get_logger
from unison.utils.logging import RunLogHandler, console_level
from unison.utils.run_files import real_folder, write_text
from unison.utils.startup import mark

_log = get_logger("unison.recipe.run")  # the run's logger, shared by the modules of a run

Attach = Callable[[RunParts], Callable[[], str | None] | None]
"""``attach(parts)`` of :func:`train_from_config`: attaches the caller's handlers; it may return
``ended_early()``, asked once training returns: why the run takes no test phase, or None."""


class ResumeError(ValueError):
    """A ``--resume`` that names no run to continue; raised before any rank is spawned."""


def is_run_dir(folder: Path) -> bool:
    """Whether ``folder`` is a unison run folder: it has the marker, or a checkpoint manifest."""
    return (folder / RUN_MARKER).is_file() or (folder / "checkpoints" / "manifest.json").is_file()


def previous_run(run_root: Path, resume: str | None) -> tuple[Path, str] | None:
    """The run a ``resume`` continues, and what to resume it from; None for a fresh run.

    ``run_root`` is the folder of the config's runs (``plan.run_root``: ``<root>/<name>``).
    ``"auto"``: the newest run under it with a checkpoint manifest (None when
    there is none); a checkpoint file inside a run folder (``<run>/checkpoints/<file>``); or
    a run folder. Reads the filesystem only, so it runs before any rank is spawned.

    Raises:
        ResumeError: when ``resume`` names a path that does not exist, or one that is not in
            a unison run folder (a run is never resumed, and nothing is written, elsewhere).
    """
    if resume is None:
        return None
    if resume == "auto":
        previous = sorted(run_root.glob("*/checkpoints/manifest.json"), key=_run_order)
        return (previous[-1].parent.parent, "auto") if previous else None
    target = Path(resume)
    expected = "a checkpoint (<run>/checkpoints/<name>.pt, or a sharded <name>.dcp), a run folder, or 'auto'"
    if not target.exists():
        raise ResumeError(f"--resume {resume}: no such file or folder. Give {expected}.")
    if target.is_file() or target.suffix == ".dcp":  # a checkpoint file, or a sharded checkpoint's folder
        run_dir = target.parent.parent
        if target.parent.name != "checkpoints" or not is_run_dir(run_dir):
            raise ResumeError(
                f"--resume {resume}: this checkpoint is not in a unison run folder (<run>/checkpoints/<name>, the "
                f"run holding {RUN_MARKER} or checkpoints/manifest.json), so there is no run to continue and "
                f"nothing may be written beside it. Give {expected}."
            )
        return run_dir, str(target)
    for run_dir in (target, target.parent):
        if is_run_dir(run_dir) and (run_dir == target or target.name == "checkpoints"):
            return run_dir, "auto"
    raise ResumeError(
        f"--resume {resume}: this folder is not a unison run folder (it holds neither {RUN_MARKER} nor "
        f"checkpoints/manifest.json). Give {expected}."
    )


def _run_dir(plan: RunPlan, resume: str | None) -> tuple[Path, str | None]:
    """Rank 0 picks the run directory (and the checkpoint to resume); every rank gets it."""
    choice: tuple[str, str | None] | str | None = None
    if get_rank() == 0:
        root = plan.run_root
        job = run_job(resume)  # under torchrun with an id: the job's own run, restarts resume it
        found = previous_run(root, resume) if job is None else job_previous_run(root, job, explain=True)
        if found is not None:
            try:
                refuse_unsafe(found[0], ResumeError)  # checked before spawning too; again where it is used
                choice = (str(found[0]), found[1])
            except ResumeError as err:
                choice = str(err)  # every rank raises it
        else:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            run_dir = new_run_folder(root, stamp) if job is None else new_job_run(root, stamp, job)
            choice = (str(run_dir), None)  # made now: never shared
            if resume == "auto":
                _log.info("resume=auto: no earlier run of %r under %s; starting fresh.", plan.name, root)
    choice = broadcast_object(choice)
    if isinstance(choice, str):
        raise ResumeError(choice)
    assert choice is not None
    return Path(choice[0]), choice[1]


def _run_order(manifest: Path) -> tuple[str, int]:
    """Run folders in the order they were made: ``<stamp>``, ``<stamp>-1``, ..., ``<stamp>-10``."""
    head, _, tail = manifest.parent.parent.name.rpartition("-")
    if head and tail.isdigit() and "-" in head:  # <date>-<time>-<n>
        return head, int(tail)
    return manifest.parent.parent.name, 0


def _file_logging(run_dir: Path) -> logging.Handler:
    """Copies the ``unison`` logger's records to ``run_dir/logs/rank<N>.log``; returns the handler."""
    handler = RunLogHandler(real_folder(run_dir / "logs") / f"rank{get_rank()}.log")  # never through a link
    handler.setFormatter(
        logging.Formatter(f"[rank {get_rank()}] %(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logging.getLogger("unison").addHandler(handler)
    return handler


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
    run_dir, resume_from = _run_dir(planned, resume)
    with hold_folder(run_dir):  # one job per run folder (unison.checkpoint.lock): refused on every rank
        if get_rank() == 0:
            write_text(run_dir / RUN_MARKER, "", "a")  # no file here follows a link (unison.utils.run_files)
            if resume_from is not None:
                record_changes(planned, run_dir)
            write_text(run_dir / "config.yaml", planned.record_yaml)  # URL credentials masked
        barrier()  # the folder exists before any rank writes into it
        log_file = _file_logging(run_dir)
        mark("run_folder")
        try:
            return _train(planned, run_dir, resume_from, attach)
        except SystemExit as stop:
            if stop.code == EXIT_PREEMPTED and get_rank() == 0:  # saved at an agreed iteration
                _log.warning(
                    "preempted; to continue this run: %s",
                    resume_command(planned.refs.origin, run_dir, script()),
                )
            raise
        finally:
            logging.getLogger("unison").removeHandler(log_file)
            log_file.close()


def _train(
    plan: RunPlan, run_dir: Path, resume_from: str | None, attach: Attach | None = None
) -> dict[str, Any]:
    """Builds the run in its steps, resumes it when asked, trains, then tests and writes results."""
    world = get_world_size()
    _log.info("run directory: %s (world size %d)", run_dir, world)
    report_accepted(plan.accepted)  # keys of other trainers' configs that are not needed here, once
    parts = build_run(plan, run_dir, world)
    ended_early = attach(parts) if attach is not None else None
    t = plan.trainer
    resumed = apply_on_resume(plan, parts, resume_run(parts, resume_from))  # the config's values win
    if resumed is not None and parts.trainer.is_complete(t.max_epochs):
        _log.info(
            "the run in %s is complete (epoch %d of %d): nothing to do, nothing written. Set a larger "
            "training.max_epochs to train further.",
            run_dir,
            parts.trainer.state.epoch,
            t.max_epochs,
        )
        RunHistory(run_dir, parts.history).restore(
            parts.trainer.state.epoch
        )  # the run's rows, as metrics.json has
        return {**collect_results(parts, run_dir, world), "complete": True}
    try:
        with meta_tensors_named(parts.trainer):  # a meta tensor the user's code kept, named with its cause
            parts.trainer.run(parts.train_loader, max_epochs=t.max_epochs, epoch_length=t.epoch_length)
    except EmptyDataError as err:  # an evaluator's own is not the training data's
        if err.engine_name != parts.trainer.name:
            raise
        raise empty_training_data(plan, err) from None
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
        config = load_config(config, overrides)
    elif overrides:
        raise ValueError("run(overrides=...) applies to a config file; edit the Config object instead.")
    mark("config")
    launcher = detect_launcher()
    if launcher.kind == "none" and (nproc or config.parallel.nproc_per_node) is not None:
        start_fork_server()  # the ranks' imports, done once while this process plans and checks
    world = launch_world_size(config, nproc)  # a global batch size is divided by it: checked here
    planned = plan(config, world_size=world)  # every slot resolved, every derived value computed once
    mark("plan")
    if launcher.kind != "none" and nproc is not None:
        raise ValueError(
            f"--nproc {nproc} was given, but this process is already one rank started by {launcher.describe()}; "
            "leave --nproc out under torchrun or srun."
        )
    nproc_per_node = (
        None if launcher.kind != "none" else nproc if nproc is not None else planned.launch.nproc_per_node
    )
    # Fail before spawning: kwargs, the device, the output folder, and the model on meta unless this
    # process trains next (a tensor the user's code keeps from that build would reach training).
    preflight(planned, trains_here=nproc_per_node is None)
    job = run_job(resume, explain=False)  # torchrun with an id: every rank checks the job's run
    found = previous_run(planned.run_root, resume) if job is None else job_previous_run(planned.run_root, job)
    if found is not None:
        refuse_unsafe(found[0], ResumeError)  # a run folder with links where unison writes: before any rank
        # A change no checkpoint can follow fails here, not in a rank; so does a schedule or a
        # stream of another shape than the checkpoint's.
        check_resume(planned, found[0])
        world = launcher.world_size if launcher.kind != "none" else nproc_per_node or 1
        check_resume_shape(planned, found[0], found[1], world)
    if launcher.kind == "none":
        check_port(planned)  # a busy port fails here, not after the ranks started
        refuse_if_held(found, ResumeError)  # so does a run folder another job holds (rank 0 takes it again)
    mark("checks")
    return launch_config(config, planned, resume, nproc_per_node)[0]


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
