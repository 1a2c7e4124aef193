"""``unison export --format safetensors``: the weights without pickle, with the run's config and
final metrics as metadata, tied weights stored once.

The truth is the ``pt`` export of the same checkpoint (itself checked against the saved
model in test_export.py): a plain model loaded from the safetensors file with
``safetensors.torch.load_file`` predicts exactly what one loaded from the ``pt`` file does.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model, save_file
from test_export import SAVES, export, make_model, make_run
from torch import nn

from unison.checkpoint.io import atomic_save
from unison.checkpoint.manifest import Entry, Manifest, checkpoint_name

CONFIG = (
    "name: tiny\nmodel:\n  type: !pyobject torch.nn.Linear\ndata:\n  build: !pyobject x.build\n"
    "checkpoint:\n  mode: max\ntuning:\n  storage: postgresql://optuna:s3cret@db.example.org/studies\n"
)
METRICS = {"validation": {"acc": 0.9}, "test": {"acc": 0.875}, "epochs": 2}


@pytest.mark.parametrize(("checkpoint", "index"), [("best", 1), ("last", 3)])  # a sharded folder, each
def test_a_plain_model_loaded_from_the_file_predicts_as_the_pt_export(tmp_path, capsys, checkpoint, index):
    run = make_run(tmp_path, SAVES)
    (run / "config.yaml").write_text(CONFIG)
    (run / "metrics.json").write_text(json.dumps(METRICS))
    assert export(run, "--checkpoint", checkpoint, "--format", "safetensors") == 0
    assert export(run, "--checkpoint", checkpoint) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith(f"exported {run / 'model.safetensors'}: ")

    models = {}
    for name, state in (
        ("safetensors", load_file(run / "model.safetensors")),
        ("pt", torch.load(run / "model.pt", weights_only=True)),
    ):
        models[name] = make_model(1000).eval()
        models[name].load_state_dict(state, strict=True)
    x = torch.randn(16, 3, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(models["safetensors"](x), models["pt"](x))
        assert torch.equal(models["pt"](x), make_model(index).eval()(x))

    with safe_open(run / "model.safetensors", "pt") as fh:
        metadata = fh.metadata()
    assert metadata["format"] == "pt"
    assert json.loads(metadata["unison.checkpoint"])["epoch"] == index + 1
    assert json.loads(metadata["unison.metrics"]) == METRICS
    assert (
        "s3cret" not in metadata["unison.config"]
        and "postgresql://optuna:***@db" in metadata["unison.config"]
    )
    assert "unison.tied" not in metadata


class Tied(nn.Module):
    """An embedding whose weight is also the output layer's (two state_dict keys, one tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


def test_tied_weights_are_stored_once_and_tie_again_on_loading(tmp_path, capsys):
    torch.manual_seed(0)
    model = Tied()
    run = tmp_path / "run"
    folder = run / "checkpoints"
    folder.mkdir(parents=True)
    name = checkpoint_name("ckpt", 1, 5)
    atomic_save(
        {"meta": {"epoch": 1, "iteration": 5, "sequence": 1}, "objects": {"model": model.state_dict()}},
        folder / name,
    )
    manifest = Manifest(folder)
    manifest.add(Entry(name, 1, 5, None, sequence=1))
    manifest.write()
    with pytest.raises(RuntimeError, match="share memory"):  # what safetensors does with the state_dict as is
        save_file(model.state_dict(), tmp_path / "naive.safetensors")

    assert export(run, "--format", "safetensors") == 0
    path = run / "model.safetensors"
    with safe_open(path, "pt") as fh:
        assert sorted(fh.keys()) == ["embed.weight"]
        assert json.loads(fh.metadata()["unison.tied"]) == {"head.weight": "embed.weight"}
    x = torch.tensor([[0, 3, 6]])
    for how in ("load_model", "load_file"):
        fresh = Tied()
        if how == "load_model":
            missing, unexpected = load_model(fresh, path)
        else:
            missing, unexpected = fresh.load_state_dict(load_file(path), strict=False)
            assert list(missing) == ["head.weight"]  # filled through its tie
            missing = []
        assert not missing and not unexpected
        assert fresh.head.weight is fresh.embed.weight
        with torch.no_grad():
            assert torch.equal(fresh(x), model(x)), how
    assert "1 tensors" in capsys.readouterr().out  # the file's count: the tied pair once


def test_without_safetensors_installed_the_error_gives_the_install_line(tmp_path, capsys, monkeypatch):
    run = make_run(tmp_path, SAVES)
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    assert export(run, "--format", "safetensors") == 2
    err = capsys.readouterr().err
    assert (
        "--format safetensors needs the safetensors package" in err and "pip install 'unison[export]'" in err
    )
    assert not (run / "model.safetensors").exists()
    with pytest.raises(SystemExit) as exit_:  # the parser refuses a format it does not know
        export(run, "--format", "onnx")
    assert exit_.value.code == 2 and "invalid choice: 'onnx'" in capsys.readouterr().err


def test_an_export_of_a_path_ending_in_pt_is_still_safetensors_when_asked(tmp_path):
    run = make_run(tmp_path, SAVES)
    out = tmp_path / "weights.pt"
    assert export(run, "--format", "safetensors", "--out", out) == 0
    assert sorted(load_file(out)) == sorted(make_model(0).state_dict())
    assert Path(out).read_bytes()[8:9] == b"{"  # a safetensors header, not a zip archive


@pytest.mark.parametrize("name", ["config.yaml", "metrics.json"])
def test_a_linked_run_file_is_refused_and_nothing_it_points_to_is_embedded(tmp_path, capsys, name):
    run = make_run(tmp_path, SAVES)
    (run / "config.yaml").write_text(CONFIG)
    (run / "metrics.json").write_text(json.dumps(METRICS))
    secret = tmp_path / "environ"
    secret.write_text('{"REGISTRY_TOKEN": "tok-9f8e7d"}\n')
    (run / name).unlink()
    (run / name).symlink_to(secret)
    assert export(run, "--format", "safetensors") == 2
    err = capsys.readouterr().err
    assert f"{run / name} is a symbolic link" in err and "rm " in err
    assert not (run / "model.safetensors").exists()


@pytest.mark.timeout(60)
def test_a_fifo_or_oversized_run_file_is_refused_without_waiting(tmp_path, capsys):
    run = make_run(tmp_path, SAVES)
    os.mkfifo(run / "metrics.json")
    assert export(run, "--format", "safetensors") == 2
    assert f"{run / 'metrics.json'} is a FIFO" in capsys.readouterr().err
    (run / "metrics.json").unlink()
    (run / "config.yaml").write_text("name: tiny\n# " + "x" * (5 * 2**20) + "\n")
    assert export(run, "--format", "safetensors") == 2
    assert f"{run / 'config.yaml'} holds more than" in capsys.readouterr().err
    assert not (run / "model.safetensors").exists()
