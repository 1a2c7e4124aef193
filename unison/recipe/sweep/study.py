"""``unison tune``: an Optuna study whose trials are whole distributed runs, pruned in agreement.

How a sweep goes:

- :func:`~unison.recipe.sweep.space.plan_sweep` reads the config and checks the ``tuning:``
  section, Optuna's sampler and pruner, and every value the search space can draw, before
  any process is spawned.
- This process (the *sweep process*) opens the study (default: a SQLite file in the sweep
  folder, ``<logging.root>/<name>/tune-<study_name>/study.db``) and is the only process
  that ever touches the storage. It asks the study for a trial, applies the drawn values
  as ``--set`` overrides, and launches the trial's ranks as ``unison run`` does, into
  ``<sweep folder>/trial-<number>/<timestamp>/`` (checkpoints, TensorBoard, metrics.json,
  and a ``trial.json`` written here).
- Pruning is decided once and agreed: after each validation, rank 0 sends the metric to
  the sweep process (:mod:`unison.recipe.sweep.decision_server`), which calls
  ``trial.report(value, step=epoch)`` and ``trial.should_prune()`` once and answers;
  rank 0 votes in the trainer's sync point
  (:class:`~unison.handlers.pruning.AgreedPruning`), and all ranks stop after the same
  iteration, or all go on. No rank asks the pruner or decides on its own.

  Why the sweep process and not rank 0: with one owner of the study, nothing depends on
  several processes writing one SQLite file (its locks, Optuna's per-process cache of
  trials), an RDB (``postgresql://...``) sees one client per sweep, and the trial is
  marked PRUNED, COMPLETE or FAIL by the process that asked for it, whatever happened
  to the ranks.
- A pruned trial is told PRUNED; a finished one is told the best value of the metric over
  its validations (the value of its best checkpoint). Ctrl-C, SIGTERM or SIGUSR1 (a
  scheduler), a failed rank, or a config error mark the running trial FAIL, never leave it
  RUNNING, and end the sweep with the signal's exit code (75 when the ranks saved a
  preemption checkpoint).
- ``--trials N`` is the number of finished trials (COMPLETE + PRUNED) the study should
  hold: a second ``unison tune`` with the same storage and study name runs only the
  missing ones (FAIL trials do not count). At the end the best trial is printed and its
  config written to ``<sweep folder>/best.yaml``, which ``unison run`` accepts
  (:mod:`unison.recipe.sweep.best`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from unison.config import load_config
from unison.distributed import detect_launcher
from unison.distributed.fork_server import fork_server_now
from unison.recipe.build.preflight import check_port, preflight
from unison.recipe.build.tracking_wandb import wandb_trial_overrides
from unison.recipe.phases import launch_config
from unison.recipe.planning.run_plan import launch_world_size
from unison.recipe.planning.run_plan import plan as plan_run
from unison.recipe.sweep.best import run_command, write_best
from unison.recipe.sweep.decision_server import AttachPruning, DecisionServer
from unison.recipe.sweep.mlflow_marks import mark_best, mark_trial
from unison.recipe.sweep.space import (
    SweepPlan,
    as_overrides,
    import_optuna,
    optuna_object,
    plan_sweep,
    suggest,
)
from unison.recipe.sweep.storage import fail_stale_trials, make_storage, optuna_quiet
from unison.recipe.sweep.tracking_sweep import SweepRun, sweep_tracking, trial_overrides
from unison.recipe.sweep.trial_loop import Loop, counts, finished, short_of, used_up
from unison.utils import get_logger
from unison.utils.secrets import redact_url

_log = get_logger(__name__)

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class SweepStopped(Exception):
    """A signal reached the sweep process between trials' launches; the running trial is FAIL."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"{signal.Signals(signum).name} reached the sweep")


@contextlib.contextmanager
def _signals_stop_the_sweep() -> Iterator[None]:
    """Turns the first SIGINT, SIGTERM or SIGUSR1 into :class:`SweepStopped` (later ones are
    ignored while the trial is marked FAIL). During a launch, the launcher's own relay holds
    them instead: it forwards them to the ranks and exits with the code that says what happened."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        for sig in _STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        raise SweepStopped(signum)

    previous = {sig: signal.signal(sig, stop) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _why(err: BaseException) -> str:
    if isinstance(err, SweepStopped):
        return f"{signal.Signals(err.signum).name} reached the sweep"
    if isinstance(err, KeyboardInterrupt):
        return "interrupted (Ctrl-C)"
    if isinstance(err, SystemExit):
        code = err.code if isinstance(err.code, int) else 1
        if code == 75:
            return "preempted: the ranks saved a checkpoint and exited with 75"
        if code > 128:
            return f"the ranks were stopped by {signal.Signals(code - 128).name}"
        return f"the ranks exited with code {code}"
    first = str(err).strip().splitlines()
    return f"{type(err).__name__}: {first[0] if first else ''}"


def open_study(plan: SweepPlan) -> Any:
    """Creates or loads the study of ``plan``; its direction must be the config's."""
    optuna = import_optuna()
    t, refs = plan.config.tuning, plan.refs
    sampler, pruner = optuna_object(t, refs, "sampler"), optuna_object(t, refs, "pruner")
    try:
        with optuna_quiet():  # the sweep says what it found in its own line
            study = optuna.create_study(
                storage=make_storage(plan.storage, plan.root),
                study_name=plan.study_name,
                direction=plan.direction,
                sampler=sampler,
                pruner=pruner,
                load_if_exists=t.load_if_exists,
            )
    except optuna.exceptions.DuplicatedStudyError:
        raise plan.refs.origin.error(
            ("tuning", "load_if_exists"),
            f"the storage {shown_storage(plan.storage)} holds a study named {plan.study_name!r} already; set load_if_exists: "
            "true to continue it, or give another tuning.study_name",
        ) from None
    except Exception as err:  # a missing driver, an unreachable server, a file that is no database
        raise plan.refs.origin.error(
            ("tuning", "storage"),
            f"cannot open the storage {shown_storage(plan.storage)}: {type(err).__name__}: {err}",
        ) from None
    found = study.direction.name.lower()
    if found != plan.direction:
        raise plan.refs.origin.error(
            ("tuning", "direction"),
            f"the study {plan.study_name!r} in {shown_storage(plan.storage)} was made to {found}; this config says "
            f"{plan.direction}. Give another tuning.study_name for a new study",
        )
    fail_stale_trials(study)  # a killed sweep's RUNNING trials: FAIL, their values asked again
    started = len(study.get_trials(deepcopy=False))
    if started and isinstance(t.sampler_kwargs.get("seed"), int):
        # A resumed study re-seeded alike would draw its first trials' values again.
        study.sampler = optuna_object(t, refs, "sampler", seed_offset=started)
    return study


def _trial_value(results: dict[str, Any], plan: SweepPlan) -> float | None:
    """The trial's value: the best of the metric over its validations (its best checkpoint's)."""
    values = [row[f"val_{plan.metric}"] for row in results.get("history", []) if f"val_{plan.metric}" in row]
    if not values and plan.metric in results.get("validation", {}):
        values = [results["validation"][plan.metric]]
    values = [float(v) for v in values if v is not None]
    if not values or not all(math.isfinite(v) for v in values):
        return None
    return max(values) if plan.direction == "maximize" else min(values)


def _write_record(run_dir: Path | None, record: dict[str, Any]) -> None:
    if run_dir is not None and run_dir.is_dir():
        (run_dir / "trial.json").write_text(json.dumps(record, indent=2, default=str) + "\n")


def run_trial(
    trial: Any, plan: SweepPlan, nproc: int | None, tracking: SweepRun | None = None
) -> dict[str, Any]:
    """Runs ``trial`` (asked by Optuna's loop) on its ranks, and says how it ended.

    With ``tracking`` (``logging.mlflow``), the trial's MLflow run is nested under the sweep's.

    Returns:
        The trial's record (also written to ``<its run folder>/trial.json``), its ``state``
        PRUNED, COMPLETE (with ``value``) or FAIL (no finite value); the caller tells the study.

    Raises:
        BaseException: whatever ended the trial other than a finished or pruned run (a
            signal, a failed rank, a config error), after its record is written; the study
            marks it FAIL.
    """
    record: dict[str, Any] = {"number": trial.number, "study": plan.study_name}
    try:
        params = {key: suggest(trial, key, spec) for key, spec in plan.space.items()}
        sets = as_overrides(params)
        record.update(params=params, overrides=sets)
        trial.set_user_attr("overrides", sets)
        layout = [
            f"name=trial-{trial.number:04d}",
            f"logging.root={json.dumps(str(plan.folder))}",
            "training.path=null",
            *TRIAL_QUIET,
            *trial_overrides(tracking, trial.number),
            *wandb_trial_overrides(plan.config, plan.study_name, trial.number),  # logging.wandb: grouped
        ]
        config = load_config(plan.path, [*plan.overrides, *sets, *layout])
        # the trial's plan at its ranks: a trial in this process (nproc None) trains from it
        planned = plan_run(config, world_size=launch_world_size(config, nproc))
        preflight(planned, trains_here=nproc is None)
        _log.debug("trial %d: %s", trial.number, "  ".join(sets))  # its one line comes when it ends
        with DecisionServer(trial, plan.metric) as server:
            if detect_launcher().kind == "none" and nproc is not None:
                check_port(planned)
            attach = AttachPruning(plan.metric, server.judge(config.parallel.timeout))
            # The fork server imports torch once for all trials; the ranks print errors only.
            results = launch_config(
                config, planned, None, nproc, attach, start_method="forkserver", quiet=True
            )
        record["reported"] = dict(server.reported)
        _judge(trial, plan, server.pruned_at, results, record)
    except BaseException as err:
        record.update(state="FAIL", reason=_why(err))
        with contextlib.suppress(Exception):
            trial.set_user_attr("fail_reason", record["reason"])
        found = sorted(plan.folder.glob(f"trial-{trial.number:04d}/*/"))
        _write_record(found[-1] if found else None, record)
        mark_trial(tracking, found[-1] if found else None, record)
        _log.error("trial %d marked FAIL: %s  %s", trial.number, record["reason"], _params(record))
        raise
    mark_trial(tracking, Path(record["run_dir"]), record)
    return record


def _params(record: dict[str, Any]) -> str:
    """The trial's drawn values, as its one line shows them."""
    return "  ".join(record.get("overrides", []))


def _judge(
    trial: Any, plan: SweepPlan, pruned_at: int | None, results: list[Any], record: dict[str, Any]
) -> None:
    """How a trial whose ranks returned ended: PRUNED, COMPLETE (its best value), or FAIL without a
    finite value, into ``record``; writes ``trial.json`` into its run folder."""
    run_dir = Path(results[0]["run_dir"])
    ranks = [
        {"rank": r, "epochs": res["epochs"], "iterations": res["iterations"]} for r, res in enumerate(results)
    ]
    record.update(run_dir=str(run_dir), ranks=ranks)
    trial.set_user_attr("run_dir", str(run_dir))
    value = _trial_value(results[0], plan)
    params = _params(record)
    if pruned_at is not None:
        record.update(state="PRUNED", pruned_at_epoch=pruned_at)
        _log.info("trial %d PRUNED after epoch %d  %s  (%s)", trial.number, pruned_at, params, run_dir)
    elif value is None:
        record.update(state="FAIL", reason=f"no finite value of {plan.metric} (a diverged run?)")
        trial.set_user_attr("fail_reason", record["reason"])
        _log.warning("trial %d marked FAIL: %s  %s  (%s)", trial.number, record["reason"], params, run_dir)
    else:
        record.update(state="COMPLETE", value=value)
        _log.info("trial %d COMPLETE: %s %.6g  %s  (%s)", trial.number, plan.metric, value, params, run_dir)
    _write_record(run_dir, record)


TRIAL_QUIET = ("logging.progress=false",)
"""``--set`` items of every trial: the sweep prints one line per trial, no progress bar (and the ranks
print errors only: ``launch_config(quiet=True)``; their log files keep every line)."""


def shown_storage(storage: str) -> str:
    """``storage`` as printed: a URL's password is masked."""
    return redact_url(storage)


def tune(
    config: str | os.PathLike[str],
    *,
    trials: int,
    nproc: int | None = None,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Runs a sweep: trials of the config's ``tuning:`` search space until the study holds ``trials``
    finished (COMPLETE or PRUNED) trials, then writes the best config.

    Args:
        config: the config file; its ``tuning:`` section says what to search.
        trials: the finished trials the study should hold; a resumed study runs the rest.
        nproc: ranks per trial; default ``parallel.nproc_per_node`` (none: one process).
        overrides: ``KEY.PATH=VALUE`` settings, as ``--set``, for every trial.

    Returns:
        The study's name, storage and folder, its trials by state, this call's trial records,
        the best trial (``None`` without a complete one) with its ``best.yaml``, and ``short``:
        why the study holds fewer than ``trials`` finished trials, or None.

    Raises:
        ConfigError: before anything is spawned, for any problem of the config.
        MissingOptunaError: when Optuna is not installed (``pip install 'unison[tune]'``).
        RankFailedError, SweepStopped, SystemExit, KeyboardInterrupt: what ended the sweep,
            after the running trial is marked FAIL.
    """
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"--trials must be a positive number of trials, got {trials!r}")
    import_optuna()
    launcher = detect_launcher()
    if launcher.kind != "none":
        raise ValueError(
            f"unison tune runs as one process and spawns each trial's ranks itself, but this process is one rank "
            f"started by {launcher.describe()}. Run unison tune directly, with --nproc."
        )
    plan = plan_sweep(config, list(overrides or []), nproc=nproc)
    nproc = nproc if nproc is not None else plan.config.parallel.nproc_per_node
    if nproc is not None:  # every trial's ranks fork from this process's imports, config's included
        fork_server_now()  # now, before the study's storage is open and a trial's threads run
    plan.folder.mkdir(parents=True, exist_ok=True)
    study = open_study(plan)
    before = counts(study)
    done = finished(before)
    todo = max(0, trials - done)
    _log.info(
        "study %r in %s: %d finished trials (%s); running %d more to reach --trials %d "
        "(COMPLETE and PRUNED trials count; FAIL ones do not)",
        plan.study_name,
        shown_storage(plan.storage),
        done,
        ", ".join(f"{v} {k}" for k, v in sorted(before.items())) or "none yet",
        todo,
        trials,
    )
    records: list[dict[str, Any]] = []
    loop = Loop(trials)
    with sweep_tracking(plan) as tracking, _signals_stop_the_sweep():  # logging.mlflow: the sweep's run
        if todo and not used_up(study):
            loop.run(study, lambda trial: run_trial(trial, plan, nproc, tracking), records)
        mark_best(tracking, study, plan.metric)  # the sweep's run: the best value and trial
    short = short_of(study, trials, loop)
    best_yaml = write_best(study, plan, nproc)
    best = None
    if best_yaml is not None:
        b = study.best_trial
        command = run_command(best_yaml, nproc)
        best = {
            "number": b.number,
            "value": b.value,
            "params": dict(b.params),
            "config": str(best_yaml),
            "command": command,
        }
    return {
        "study": plan.study_name,
        "storage": shown_storage(plan.storage),
        "folder": str(plan.folder),
        "metric": plan.metric,
        "direction": plan.direction,
        "counts": counts(study),
        "trials": records,
        "best": best,
        "short": short,
    }
