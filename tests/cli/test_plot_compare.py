"""unison plot --compare: several runs' curves on one figure, labelled by the settings that differ."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tensorboardX import SummaryWriter

from unison.cli import main
from unison.cli.plot_compare import compare_figure, plot_compare, run_labels
from unison.config import Config, dump_config
from unison.config.loader import PyObjectRef

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _set(config: Config, dotted: str, value: Any) -> None:
    *path, last = dotted.split(".")
    target: Any = config
    for part in path:
        target = target[part] if isinstance(target, dict) else getattr(target, part)
    if isinstance(target, dict):
        target[last] = value
    else:
        setattr(target, last, value)


def _run(
    folder: Path, changes: dict[str, Any] | None = None, *, scale: float = 1.0, config: bool = True
) -> Path:
    """A run folder as ``unison run`` leaves it: config.yaml (every default filled in) and tb/."""
    c = Config()
    c.name = "digits"
    for key, value in (changes or {}).items():
        _set(c, key, value)
    folder.mkdir(parents=True)
    if config:
        (folder / "config.yaml").write_text(dump_config(c))
    with SummaryWriter(str(folder / "tb")) as writer:
        for step in (4, 8, 12):
            writer.add_scalar("train/loss", scale / step, step)
            writer.add_scalar("val/accuracy", 1 - scale / step, step)
        writer.add_scalar("train/lr", 0.01, 12)
    return folder


def _label_keys(label: str) -> list[str]:
    return [item.split("=", 1)[0] for item in label.split(", ")]


def test_labels_name_exactly_the_settings_that_differ(tmp_path: Path) -> None:
    changes = [
        {"training.lr": 0.01, "training.batch_size": 32, "model.kwargs": {"hidden": 64}},
        {"training.lr": 0.003, "training.batch_size": 32, "model.kwargs": {"hidden": 64}},
        {"training.lr": 0.01, "training.batch_size": 64, "model.kwargs": {"hidden": 128}},
    ]
    runs = [_run(tmp_path / f"run{i}", c) for i, c in enumerate(changes)]
    labels = run_labels(runs)
    differing = ["training.batch_size", "training.lr", "model.kwargs.hidden"]  # the config's key order
    assert [_label_keys(label) for label in labels] == [differing] * 3
    assert labels[0] == "training.batch_size=32, training.lr=0.01, model.kwargs.hidden=64"
    assert labels[1] == "training.batch_size=32, training.lr=0.003, model.kwargs.hidden=64"
    assert labels[2] == "training.batch_size=64, training.lr=0.01, model.kwargs.hidden=128"


def test_references_and_unset_keys_are_shown_plainly(tmp_path: Path) -> None:
    a = _run(tmp_path / "a", {"training.optimizer_type": PyObjectRef("torch.optim.SGD")})
    b = _run(tmp_path / "b", {"training.optimizer_kwargs": {"momentum": 0.9}})
    assert run_labels([a, b]) == [
        "training.optimizer_type=torch.optim.SGD, training.optimizer_kwargs.momentum=unset",
        "training.optimizer_type=torch.optim.AdamW, training.optimizer_kwargs.momentum=0.9",
    ]


def test_a_section_set_in_one_run_and_off_in_another_is_one_label_item(tmp_path: Path) -> None:
    from unison.config.profiling import ProfileConfig

    a = _run(tmp_path / "a")
    b = _run(tmp_path / "b", {"training.profile": ProfileConfig(active=5)})
    assert run_labels([a, b]) == [
        "training.profile=null",
        "training.profile={wait: 1, warmup: 1, active: 5, repeat: 1}",
    ]


def test_without_a_difference_the_run_folders_label_the_runs(tmp_path: Path) -> None:
    a = _run(tmp_path / "digits" / "20250101-120000")
    b = _run(tmp_path / "other" / "20250101-130000", {"logging.root": "elsewhere"})  # where, not how
    c = _run(tmp_path / "digits" / "20250101-140000", config=False)
    assert run_labels([a, b]) == ["digits/20250101-120000", "other/20250101-130000"]
    d = _run(tmp_path / "digits" / "20250101-150000", {"training.lr": 0.5})
    # A run without config.yaml keeps its folder; the others still show what differs among them.
    assert run_labels([a, c, d]) == ["training.lr=null", "digits/20250101-140000", "training.lr=0.5"]


def test_runs_with_the_same_settings_among_others_get_their_folder_too(tmp_path: Path) -> None:
    a = _run(tmp_path / "s" / "a", {"training.lr": 0.1})
    b = _run(tmp_path / "s" / "b", {"training.lr": 0.1})
    c = _run(tmp_path / "s" / "c", {"training.lr": 0.2})
    assert run_labels([a, b, c]) == ["training.lr=0.1 (s/a)", "training.lr=0.1 (s/b)", "training.lr=0.2"]


def test_the_figure_has_a_panel_per_tag_and_one_legend_entry_per_run(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    a = _run(tmp_path / "a", {"training.lr": 0.1})
    b = _run(tmp_path / "b", {"training.lr": 0.2}, scale=2.0)
    figure = compare_figure([a, b])
    titles = [ax.get_title() for ax in figure.axes if ax.get_visible()]
    assert titles == ["train/loss", "val/accuracy", "train/lr"]
    (legend,) = figure.legends
    assert [t.get_text() for t in legend.get_texts()] == run_labels([a, b])
    loss_panel = figure.axes[0]
    assert [list(line.get_ydata()) for line in loss_panel.get_lines()] == [
        pytest.approx([1 / 4, 1 / 8, 1 / 12]),
        pytest.approx([2 / 4, 2 / 8, 2 / 12]),
    ]


def test_unison_plot_compare_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    a = _run(tmp_path / "runs" / "a", {"training.lr": 0.1})
    b = _run(tmp_path / "runs" / "b", {"training.lr": 0.2})
    assert main(["plot", "--compare", str(a), str(b)]) == 0
    out = tmp_path / "runs" / "compare.png"  # the runs' common folder
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes()[:8] == PNG_MAGIC
    target = plot_compare([a, b], out=tmp_path / "x" / "c.png")
    assert target == tmp_path / "x" / "c.png" and target.read_bytes()[:8] == PNG_MAGIC
    assert main(["plot", str(a), "--compare", str(b), "--out", str(tmp_path / "y.png")]) == 0
    assert (tmp_path / "y.png").read_bytes()[:8] == PNG_MAGIC


def test_a_missing_run_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    a = _run(tmp_path / "a")
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"{missing}: no such run folder"):
        compare_figure([a, missing])
    assert main(["plot", "--compare", str(a), str(missing)]) == 2
    assert f"{missing}: no such run folder" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=f"no TensorBoard event files in {empty / 'tb'}"):
        compare_figure([a, empty])
    with pytest.raises(ValueError, match="given twice"):
        compare_figure([a, tmp_path / "a"])
    assert main(["plot"]) == 2
    assert "give a run directory" in capsys.readouterr().err
