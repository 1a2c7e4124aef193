"""What a run writes for TensorBoard, read back with the ``tensorboard`` package's own readers.

The scalars through ``event_accumulator.EventAccumulator`` (and compared with our reader),
the HParams session through the hparams plugin's protos and its own backend (the code
behind TensorBoard's HParams dashboard), and the profiler traces where TensorBoard's
profiler view looks for them. The truths are the run's ``metrics.json`` and its config.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from _cli_parts import config, parts_of, resolved
from _procs import run_in_session

from unison.cli import build_parser
from unison.config import Config, load_config
from unison.config.loader import PyObjectRef
from unison.recipe.build.tracking_tb import profile_overrides
from unison.recipe.phases import collect_results
from unison.utils.event_files import read_scalars

pytest.importorskip("tensorboard")
from tensorboard import context as tb_context  # noqa: E402
from tensorboard.backend.event_processing import (  # noqa: E402
    data_provider,
    event_accumulator,
    plugin_event_accumulator,
    plugin_event_multiplexer,
)
from tensorboard.plugins import base_plugin  # noqa: E402
from tensorboard.plugins.hparams import (  # noqa: E402
    api_pb2,
    backend_context,
    get_experiment,
    list_session_groups,
    metadata,
)

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "recipes" / "digits" / "config.yaml"
ITERATIONS, EPOCHS = 4, 2
TRACE = re.compile(r"^rank(\d+)\.\d+\.pt\.trace\.json$")


def _config_value(config: Config, dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        value = value[part] if isinstance(value, dict) else getattr(value, part)
    return value.path if isinstance(value, PyObjectRef) else value


def _session_hparams(log_dir: Path) -> tuple[dict[str, Any], int]:
    """The hparams and status of the session in ``log_dir``, through the hparams plugin's protos."""
    acc = plugin_event_accumulator.EventAccumulator(str(log_dir))
    acc.Reload()
    content = acc.PluginTagToContent(metadata.PLUGIN_NAME)
    start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    end = metadata.parse_session_end_info_plugin_data(content[metadata.SESSION_END_INFO_TAG])
    return {k: getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}, end.status


def _dashboard(logdir: Path) -> tuple[Any, Any]:
    """What TensorBoard's HParams dashboard gets for ``logdir``: the experiment, the session groups."""
    mux = plugin_event_multiplexer.EventMultiplexer()
    mux.AddRunsFromDirectory(str(logdir))
    mux.Reload()
    context = base_plugin.TBContext(
        logdir=str(logdir),
        data_provider=data_provider.MultiplexerDataProvider(mux, str(logdir)),
        multiplexer=mux,
    )
    backend = backend_context.Context(context)
    request_context = tb_context.RequestContext()
    experiment = get_experiment.Handler(
        request_context, backend, "", api_pb2.GetExperimentRequest(include_metrics=True)
    ).run()
    request = api_pb2.ListSessionGroupsRequest(
        start_index=0, slice_size=100, allowed_statuses=[api_pb2.STATUS_SUCCESS, api_pb2.STATUS_FAILURE]
    )
    for info in experiment.hparam_infos:
        request.col_params.add(hparam=info.name)
    for info in experiment.metric_infos:
        request.col_params.add(metric=info.name)
    groups = list_session_groups.Handler(request_context, backend, "", request).run()
    return experiment, groups


def _metric_values(group: Any) -> dict[str, float]:
    return {m.name.tag: m.value for m in group.metric_values}


# -- a real run: 2 ranks, with --profile ---------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_profiled_digits_run_reads_back_in_tensorboard(tmp_path: Path) -> None:
    overrides = [
        f"training.max_epochs={EPOCHS}",
        f"training.epoch_length={ITERATIONS}",
        "logging.progress=false",
        f"logging.root={tmp_path}",
    ]
    cmd = [sys.executable, "-m", "unison", "run", str(DIGITS), "--nproc", "2", "--profile", "2"]
    for item in overrides:
        cmd += ["--set", item]
    result = run_in_session(cmd, 270, ROOT)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    (run_dir,) = sorted((tmp_path / "digits").iterdir())
    metrics = json.loads((run_dir / "metrics.json").read_text())
    tb = run_dir / "tb"

    # Scalars: TensorBoard's reader sees what metrics.json holds, at the epochs' last iterations.
    acc = event_accumulator.EventAccumulator(str(tb))
    acc.Reload()
    history = metrics["history"]
    steps = [ITERATIONS * row["epoch"] for row in history]
    for tag, key in (
        ("train/loss", "train_loss"),
        ("val/accuracy", "val_accuracy"),
        ("val/loss", "val_loss"),
    ):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == steps, tag
        assert [e.value for e in events] == pytest.approx([row[key] for row in history], rel=1e-6), tag
    assert acc.Scalars("val/accuracy")[-1].value == pytest.approx(metrics["validation"]["accuracy"], rel=1e-6)
    # ... and our own reader agrees with it, tag by tag.
    ours = read_scalars(tb)
    assert set(ours) == set(acc.Tags()["scalars"])
    for tag, points in ours.items():
        assert points == [(e.step, e.value) for e in acc.Scalars(tag)], tag

    # HParams: the settings the run trained with (--profile 2 among them), and a successful end.
    expected = load_config(DIGITS, [*overrides, "training.profile.active=2"])
    hparams, status = _session_hparams(tb)
    assert status == api_pb2.STATUS_SUCCESS
    assert {name: _config_value(expected, name) for name in hparams} == hparams
    assert hparams["training.profile.active"] == 2 and hparams["training.optimizer_kwargs.lr"] == 0.003
    assert hparams["model.type"] == "digits.SmallCNN" and hparams["training.max_epochs"] == EPOCHS
    # TensorBoard's HParams dashboard lists the run with its final metrics.
    _, groups = _dashboard(run_dir.parent)
    (group,) = groups.session_groups
    assert group.name == f"{run_dir.name}/tb"
    values = _metric_values(group)
    assert values["train/loss"] == pytest.approx(metrics["train_loss"], rel=1e-6)
    assert values["val/accuracy"] == pytest.approx(metrics["validation"]["accuracy"], rel=1e-6)
    assert values["val/loss"] == pytest.approx(metrics["validation"]["loss"], rel=1e-6)

    # Profiler: one Chrome trace per rank, in one folder of the profile plugin's layout.
    (window,) = (tb / "plugins" / "profile").iterdir()
    assert window.name == "iterations-3-4"  # 1 iteration waited, 1 warmed up, 2 recorded
    traces = sorted(window.iterdir())
    assert sorted(int(TRACE.match(t.name).group(1)) for t in traces) == [0, 1]
    for trace_file in traces:
        trace = json.loads(trace_file.read_text())
        assert trace["traceEvents"]
        assert trace["distributedInfo"]["rank"] == int(TRACE.match(trace_file.name).group(1))
        steps_seen = {
            e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")
        }
        assert steps_seen == {"ProfilerStep#2", "ProfilerStep#3"}


# -- the HParams dashboard over several runs (a sweep's folder) -----------------------------------


def test_runs_in_one_folder_line_up_in_the_hparams_dashboard(tmp_path: Path) -> None:
    results = {}
    for name, lr in (("a", 0.1), ("b", 0.5)):
        c = config()
        c.logging.tensorboard = True
        c.training.max_epochs = 2
        c.training.lr = lr
        parts = parts_of(c, resolved(), tmp_path / name)
        parts.trainer.run(parts.train_loader, max_epochs=c.training.max_epochs)
        results[f"{name}/tb"] = (lr, collect_results(parts, tmp_path / name, 1))
    experiment, groups = _dashboard(tmp_path)
    lr_info = next(info for info in experiment.hparam_infos if info.name == "training.lr")
    assert lr_info.differs and (lr_info.domain_interval.min_value, lr_info.domain_interval.max_value) == (
        0.1,
        0.5,
    )
    assert {"train/loss", "val/accuracy", "val/loss"} <= {m.name.tag for m in experiment.metric_infos}
    assert sorted(g.name for g in groups.session_groups) == ["a/tb", "b/tb"]
    for group in groups.session_groups:
        lr, truth = results[group.name]
        assert group.hparams["training.lr"].number_value == lr
        assert group.sessions[0].status == api_pb2.STATUS_SUCCESS
        values = _metric_values(group)
        assert values["train/loss"] == pytest.approx(truth["train_loss"], rel=1e-6)
        for key, value in truth["validation"].items():
            assert values[f"val/{key}"] == pytest.approx(value, rel=1e-6)


# -- unison run --profile [ACTIVE] ----------------------------------------------------------------


def test_the_profile_flag_sets_the_window(tmp_path: Path) -> None:
    parse = build_parser().parse_args
    assert parse(["run", "c.yaml"]).profile is None
    assert parse(["run", "c.yaml", "--profile"]).profile == 0  # bare: the config's, else defaults
    assert parse(["run", "c.yaml", "--profile", "5", "--nproc", "2"]).profile == 5
    plain = tmp_path / "plain.yaml"
    plain.write_text("name: x\n")
    own = tmp_path / "own.yaml"
    own.write_text("training:\n  profile: {wait: 4, active: 7}\n")
    assert profile_overrides(plain, None) == ["training.profile={}"]
    assert profile_overrides(own, None) == []  # the config's own window is kept
    assert profile_overrides(own, 2) == ["training.profile.active=2"]
    window = load_config(DIGITS, profile_overrides(DIGITS, None)).training.profile
    assert window is not None and (window.wait, window.warmup, window.active, window.repeat) == (1, 1, 3, 1)


@pytest.mark.parametrize("bad", ["0", "-2", "x"])
def test_a_bad_profile_count_is_a_usage_error(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["run", "c.yaml", f"--profile={bad}"])
    assert exit_info.value.code == 2
    assert "expected a number of iterations >= 1" in capsys.readouterr().err
