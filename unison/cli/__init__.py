"""The ``unison`` command: ``run`` a config, ``tune`` it, check a machine with ``doctor``, ``plot`` a run,
``export`` its weights, show a resolved ``config`` and the config's JSON ``schema``.

The parser and :func:`main` live here; each command's code is in modules of this package,
imported only when its command runs, so ``unison --help`` stays quick: :mod:`unison.recipe.phases`
(with :mod:`unison.recipe.planning.resolved` and :mod:`unison.recipe.build.assemble`), :mod:`unison.recipe.sweep.study` (with
:mod:`unison.recipe.sweep.space`, :mod:`unison.recipe.sweep.decision_server` and :mod:`unison.recipe.sweep.best`),
:mod:`unison.cli.doctor` (with :mod:`unison.cli.doctor_checks` and :mod:`unison.cli.launch_checks`)
and :mod:`unison.cli.plot`, :mod:`unison.cli.export`, :mod:`unison.cli.config_cmd` (``config`` and ``schema``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def _run(args: argparse.Namespace) -> int:
    from unison.config import ConfigError
    from unison.config.main_script import MainScriptError
    from unison.distributed import RankFailedError, detect_launcher
    from unison.recipe.phases import ResumeError, run
    from unison.utils.secrets import redact_url

    first_rank = detect_launcher().rank == 0  # read before the group sets variables of its own
    try:
        overrides = args.set
        if args.profile is not None:  # --profile [ACTIVE]; a --set of training.profile wins
            from unison.recipe.build.tracking_tb import profile_overrides

            active = args.profile or None  # 0: a bare --profile
            overrides = [*profile_overrides(args.config, active), *args.set]
        results = run(args.config, nproc=args.nproc, overrides=overrides, resume=args.resume, main=args.main)
    except (ConfigError, ResumeError, MainScriptError) as err:
        if args.debug:
            raise
        print(f"unison run: {redact_url(str(err))}", file=sys.stderr)
        return 2
    except RankFailedError as err:
        if args.debug:
            raise
        # The message holds the failing rank's own traceback; the launcher's frames add nothing.
        print(f"unison run: {redact_url(str(err))}", file=sys.stderr)
        return 1
    if results is not None and first_rank:  # under torchrun or srun, once
        print(f"run directory: {results['run_dir']}")
    return 0


def _tune(args: argparse.Namespace) -> int:
    from unison.config.main_script import use_main
    from unison.distributed import RankFailedError
    from unison.recipe.sweep.best import summary_lines
    from unison.recipe.sweep.space import MissingOptunaError
    from unison.recipe.sweep.study import SweepStopped, tune
    from unison.utils.logging import setup_logging

    setup_logging()  # the sweep's progress lines, at INFO
    try:
        use_main(args.main)  # a MainScriptError is a ValueError
        summary = tune(args.config, trials=args.trials, nproc=args.nproc, overrides=args.set)
    except (ValueError, MissingOptunaError, RankFailedError, SweepStopped, KeyboardInterrupt) as err:
        if args.debug:
            raise
        print(f"unison tune: {str(err) or 'interrupted'}", file=sys.stderr)
        if isinstance(err, SweepStopped):
            return 128 + err.signum
        return 130 if isinstance(err, KeyboardInterrupt) else 1 if isinstance(err, RankFailedError) else 2
    print("\n".join(summary_lines(summary)))
    if summary.get("short"):
        print(f"unison tune: the study is short: {summary['short']}", file=sys.stderr)
        return 1
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from unison.cli.doctor import run_doctor

    return run_doctor(master_port=args.master_port)


def _store(args: argparse.Namespace) -> int:
    from unison.cli.store import serve_store

    return serve_store(args.port, ready=args.ready)


def _plot(args: argparse.Namespace) -> int:
    from unison.cli.plot import plot_run
    from unison.cli.plot_compare import plot_compare

    try:
        if args.compare:
            runs = [args.run_dir, *args.compare] if args.run_dir else args.compare
            print(plot_compare(runs, out=args.out))
        elif args.run_dir is not None:
            print(plot_run(args.run_dir, out=args.out))
        else:
            raise ValueError("give a run directory, or several after --compare RUN_DIR ...")
    except (FileNotFoundError, ValueError, ImportError) as err:
        print(f"unison plot: {err}", file=sys.stderr)
        return 2
    return 0


def _export(args: argparse.Namespace) -> int:
    from unison.cli.export import run_export

    return run_export(
        args.run_dir,
        checkpoint=args.checkpoint,
        out=args.out,
        ema=args.ema,
        force=args.force,
        mode=args.mode,
        debug=args.debug,
        format=args.format,
    )


def _config(args: argparse.Namespace) -> int:
    from unison.cli.config_cmd import run_config
    from unison.config.main_script import MainScriptError, use_main

    try:
        use_main(args.main)  # what --check resolves __main__.<name> in
    except MainScriptError as err:
        print(f"unison config: {err}", file=sys.stderr)
        return 2
    return run_config(args)


def _schema(args: argparse.Namespace) -> int:
    from unison.cli.config_cmd import run_schema

    return run_schema(args)


def _iterations(text: str) -> int:
    """``--profile ACTIVE``: a number of iterations, at least 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a number of iterations >= 1, got {text!r}")
    return int(text)


def _main_option(command: argparse.ArgumentParser) -> None:
    """``--main SCRIPT.py``: the script a config's ``__main__.<name>`` stands for."""
    command.add_argument(
        "--main",
        default=None,
        metavar="SCRIPT.py",
        help="your script that defines what the config names as __main__.<name> (and plain class names such "
        "as model.type: GNNModel); imported as __mp_main__ on every rank, so its "
        "`if __name__ == '__main__':` block does not run",
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``unison`` argument parser: a sub-command each for ``run``, ``tune``, ``doctor``, ``plot``, ``export``,
    ``config``, ``schema``."""
    parser = argparse.ArgumentParser(
        prog="unison", description="Distributed training in which every rank moves in unison."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser(
        "run",
        help="train what a YAML config describes",
        description="Spawns --nproc ranks locally, or runs as one rank under torchrun or srun.",
    )
    run.add_argument("config", help="the YAML config file")
    run.add_argument(
        "--nproc", type=int, default=None, help="ranks to spawn here (leave out under torchrun/srun)"
    )
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. training.lr=3e-4",
    )
    run.add_argument(
        "--resume", default=None, metavar="auto|PATH", help="'auto', a checkpoint file or a run directory"
    )
    run.add_argument(
        "--profile",
        nargs="?",
        type=_iterations,
        const=0,  # a bare --profile
        default=None,
        metavar="ACTIVE",
        help="trace ACTIVE iterations (default training.profile, else 3) with torch.profiler on every rank, "
        "into <run>/tb/plugins/profile/",
    )
    run.add_argument(
        "--debug",
        action="store_true",
        help="show the full Python traceback of an expected error (a bad config, a failed rank)",
    )
    _main_option(run)
    run.set_defaults(handler=_run)

    tune = commands.add_parser(
        "tune",
        help="sweep hyperparameters with Optuna: each trial a full run, pruned by all ranks together",
        description="Runs the trials of the config's tuning: section (pip install 'unison[tune]').",
    )
    tune.add_argument("config", help="the YAML config file, with a tuning: section")
    tune.add_argument(
        "--trials", type=int, required=True, help="finished (complete or pruned) trials the study should hold"
    )
    tune.add_argument(
        "--nproc", type=int, default=None, help="ranks per trial (default parallel.nproc_per_node)"
    )
    tune.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    tune.add_argument(
        "--debug", action="store_true", help="show the full Python traceback of an expected error"
    )
    _main_option(tune)
    tune.set_defaults(handler=_tune)

    doctor = commands.add_parser("doctor", help="check this machine for what blocks a distributed run")
    doctor.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="the rendezvous port to check (default MASTER_PORT or 29500)",
    )
    doctor.set_defaults(handler=_doctor)

    store = commands.add_parser(
        "store",
        help="serve torchrun's rendezvous store on a host that trains nothing, so that it outlives any node",
        description="Serves the TCP store of torchrun's c10d rendezvous until SIGTERM or Ctrl-C. Start every "
        "agent with --rdzv-endpoint=THISHOST:PORT --rdzv-conf=is_host=0: the job then survives the loss of "
        "any training node, rank 0's included (docs/launching.md).",
    )
    store.add_argument(
        "--port", type=int, default=29400, help="the port to serve on (default 29400; 0: a free one)"
    )
    store.add_argument("--ready", default=None, metavar="FILE", help="write the port to FILE once serving")
    store.set_defaults(handler=_store)

    plot = commands.add_parser("plot", help="draw a run's training and validation curves to a PNG")
    plot.add_argument("run_dir", nargs="?", default=None, help="a run directory (runs/<name>/<timestamp>)")
    plot.add_argument(
        "--compare",
        nargs="+",
        default=None,
        metavar="RUN_DIR",
        help="draw these runs (and run_dir, when given) on one figure, labelled by the settings that differ",
    )
    plot.add_argument(
        "--out",
        default=None,
        help="the PNG to write (default <run_dir>/curves.png; with --compare, compare.png in the runs' common folder)",
    )
    plot.set_defaults(handler=_plot)

    export = commands.add_parser(
        "export",
        help="write a run's weights as one plain state_dict file for inference",
        description="Reads a checkpoint of the run (a file, or a sharded folder put together) and writes its "
        "weights with the plain model's keys: model.load_state_dict(torch.load(OUT, weights_only=True)).",
    )
    export.add_argument("run_dir", help="a run directory (runs/<name>/<timestamp>)")
    export.add_argument(
        "--checkpoint",
        default="best",
        metavar="best|last|PATH",
        help="'best' by the recorded score (the last when none has one), 'last', or a checkpoint file or "
        ".dcp folder (default best)",
    )
    export.add_argument(
        "--out", default=None, help="the file to write (default <run_dir>/model.pt, model-ema.pt with --ema)"
    )
    export.add_argument(
        "--ema", action="store_true", help="export the EMA average instead of the trained weights"
    )
    export.add_argument("--force", action="store_true", help="replace --out when it exists")
    export.add_argument(
        "--format",
        choices=("pt", "safetensors"),
        default="pt",
        help="pt: torch.save (default); safetensors: no pickle, the run's config and final metrics as "
        "metadata, tied weights stored once (pip install 'unison[export]')",
    )
    export.add_argument(
        "--mode",
        choices=("max", "min"),
        default=None,
        help="whether higher or lower scores are better, for 'best' (default the run's checkpoint.mode)",
    )
    export.add_argument("--debug", action="store_true", help="show the full Python traceback of an error")
    export.set_defaults(handler=_export)

    config = commands.add_parser(
        "config",
        help="print the config a run would use: every key resolved, as YAML",
        description="Reads and checks the config as `unison run` does before it starts any rank, and prints it "
        "with every default filled in, old and other trainers' keys under unison's names, --set applied and "
        "URL credentials masked. Nothing the config names is imported unless --check is given.",
    )
    config.add_argument("config", help="the YAML config file")
    config.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key"
    )
    config.add_argument(
        "--check",
        action="store_true",
        help="also resolve every !pyobject and build the model on the meta device, as `unison run` does "
        "before spawning (imports the modules the config names)",
    )
    config.add_argument(
        "--show-origin", action="store_true", help="end each given key's line with # file:line or # --set ..."
    )
    config.add_argument(
        "--debug", action="store_true", help="show the full Python traceback of a config error"
    )
    _main_option(config)
    config.set_defaults(handler=_config)

    schema = commands.add_parser(
        "schema",
        help="write the config's JSON Schema, for editors",
        description="The JSON Schema (draft 2020-12) of a run config, made from this version's schema: point "
        "an editor at it (# yaml-language-server: $schema=FILE).",
    )
    schema.add_argument("--out", default=None, metavar="FILE", help="the file to write (default: print it)")
    schema.set_defaults(handler=_schema)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``unison`` command (the console script and ``python -m unison``).

    Args:
        argv: the arguments after the program name; default ``sys.argv[1:]``.

    Returns:
        The exit status: 0 on success, 2 for a config or ``--resume`` error, 1 for a failed rank
        (its traceback is in the message) or when the doctor finds a blocker.

    Example:
        .. code-block:: python

            from unison.cli import main

            main(["doctor", "--master-port", "29501"])
    """
    from unison.utils.startup import mark

    mark("cli")  # UNISON_STARTUP_TRACE (unison.utils.startup): a line per phase, when set
    args = build_parser().parse_args(argv)
    return int(args.handler(args))
