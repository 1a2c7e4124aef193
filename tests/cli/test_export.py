"""``unison export``: the weights of a run's best, last or named checkpoint, as one plain state_dict file.

The truth is the model whose weights were saved: the file written equals its
``state_dict``, loads with ``torch.load(weights_only=True)`` and into a fresh model of the
plain class with ``strict=True``, whichever kind of checkpoint (a file, a sharded folder)
and whichever wrapper (DDP's ``module.``, compile's ``_orig_mod.``) it came from.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from unison.checkpoint.io import atomic_save
from unison.checkpoint.manifest import Entry, Manifest, checkpoint_name
from unison.cli import main
from unison.engine import Events, create_trainer
from unison.handlers import EMA, Checkpoint


def make_model(seed: int) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Linear(5, 2))
        model[1].running_var.uniform_(0.5, 2.0)
    return model


def wrapped(model: nn.Module, wrapper: str) -> dict[str, torch.Tensor]:
    """``model``'s state_dict as a wrapped model gives it (DataParallel adds DDP's ``module.``)."""
    if wrapper == "ddp":
        return nn.DataParallel(model).state_dict()
    return (torch.compile(model) if wrapper == "compiled" else model).state_dict()


def make_run(root: Path, saves: list[tuple[str, float | None, str]]) -> Path:
    """A run folder whose manifest records ``saves`` (kind, score, wrapper), oldest first.

    Save ``i`` holds the weights of ``make_model(i)``, at epoch ``i + 1``.
    """
    run = root / "runs" / "tiny" / "20250101-000000"
    folder = run / "checkpoints"
    folder.mkdir(parents=True)
    (run / ".unison-run").touch()
    manifest = Manifest(folder)
    for i, (kind, score, wrapper) in enumerate(saves):
        epoch, iteration = i + 1, 10 * (i + 1)
        meta = {"epoch": epoch, "iteration": iteration, "score": score, "metric": "acc", "sequence": i + 1}
        state = wrapped(make_model(i), wrapper)
        name = checkpoint_name("ckpt", epoch, iteration)
        if kind == "dcp":
            name = name[: -len(".pt")] + ".dcp"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # no process group
                dcp.save({"model": state}, checkpoint_id=folder / name, no_dist=True)
            torch.save({"meta": {**meta, "sharded": ["model"]}, "objects": {}}, folder / name / "rest.pt")
        else:
            atomic_save({"meta": meta, "objects": {"model": state, "optimizer": {}}}, folder / name)
        manifest.add(Entry(name, epoch, iteration, score, sequence=i + 1))
    manifest.write()
    return run


def exported(path: Path, truth: nn.Module) -> dict[str, torch.Tensor]:
    """Checks the file at ``path`` against ``truth``: the same tensors, loadable into a fresh model."""
    weights = torch.load(path, weights_only=True)
    expected = truth.state_dict()
    assert sorted(weights) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(weights[key], value), key
    fresh = make_model(1000)
    fresh.load_state_dict(weights, strict=True)
    return weights


def export(*args: str) -> int:
    return main(["export", *map(str, args)])


SAVES = [("pt", 0.3, "ddp"), ("dcp", 0.9, "compiled"), ("pt", 0.5, "plain"), ("dcp", None, "ddp")]


@pytest.mark.parametrize(
    ("flags", "index"),
    [([], 1), (["--checkpoint", "best", "--mode", "min"], 0), (["--checkpoint", "last"], 3)],
    ids=["best", "best-min", "last"],
)
def test_best_and_last_pick_their_checkpoints_from_the_manifest(tmp_path, capsys, flags, index):
    run = make_run(tmp_path, SAVES)
    scored = [(score, i) for i, (_, score, _) in enumerate(SAVES) if score is not None]
    truth = {"best": max(scored)[1], "best-min": min(scored)[1], "last": len(SAVES) - 1}
    assert index == truth["last" if "last" in flags else "best-min" if "min" in flags else "best"]
    assert export(run, *flags) == 0
    exported(run / "model.pt", make_model(index))
    line = capsys.readouterr().out.strip()
    source = checkpoint_name("ckpt", index + 1, 10 * (index + 1))
    if SAVES[index][0] == "dcp":
        source = source.replace(".pt", ".dcp")
    state = make_model(index).state_dict()
    values = sum(t.numel() for t in state.values())
    assert line.startswith(f"exported {run / 'model.pt'}: {len(state)} tensors, {values:,} values, ")
    assert source in line and f"epoch {index + 1}, iteration {10 * (index + 1)}" in line


def test_best_ranks_by_the_mode_of_the_runs_config(tmp_path):
    run = make_run(tmp_path, SAVES)
    (run / "config.yaml").write_text(
        "name: tiny\nmodel:\n  type: !pyobject torch.nn.Linear\ndata:\n  build: !pyobject x.build\n"
        "checkpoint:\n  mode: min\n"
    )
    assert export(run, "--out", tmp_path / "m.pt") == 0
    exported(tmp_path / "m.pt", make_model(0))  # the lowest score


def test_best_without_any_score_exports_the_last_and_says_so(tmp_path, capsys):
    run = make_run(tmp_path, [("pt", None, "plain"), ("dcp", None, "plain")])
    assert export(run) == 0
    exported(run / "model.pt", make_model(1))
    assert "has a score" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["pt", "dcp"])
def test_last_falls_back_past_a_damaged_newest_checkpoint(tmp_path, capsys, kind):
    run = make_run(tmp_path, [("pt", 0.1, "plain"), ("dcp", 0.2, "ddp"), (kind, 0.3, "compiled")])
    newest = sorted((run / "checkpoints").glob("ckpt-e0003-*"))[0]
    if kind == "pt":
        newest.write_bytes(newest.read_bytes()[:200])
    else:
        next(newest.glob("*.distcp")).unlink()
    assert export(run, "--checkpoint", "last") == 0
    exported(run / "model.pt", make_model(1))
    err = capsys.readouterr().err
    assert f"Checkpoint {newest} is damaged" in err and "falling back to an older one" in err


def test_a_damaged_best_checkpoint_fails_naming_it(tmp_path, capsys):
    run = make_run(tmp_path, SAVES)
    best = run / "checkpoints" / checkpoint_name("ckpt", 2, 20).replace(".pt", ".dcp")
    (best / "rest.pt").unlink()
    assert export(run) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the log lines
    assert err.startswith(f"unison export: The best checkpoint {best} cannot be read: it holds no rest.pt")
    assert "--checkpoint last" in err and not (run / "model.pt").exists()


@pytest.mark.parametrize("form", ["path", "name"])
@pytest.mark.parametrize("index", [0, 1])
def test_a_checkpoint_named_by_path_or_by_its_name_in_the_run(tmp_path, form, index):
    run = make_run(tmp_path, SAVES)
    name = checkpoint_name("ckpt", index + 1, 10 * (index + 1))
    name = name.replace(".pt", ".dcp") if SAVES[index][0] == "dcp" else name
    given = run / "checkpoints" / name if form == "path" else name
    assert export(run, "--checkpoint", given, "--out", tmp_path / "out" / "w.pt") == 0
    exported(tmp_path / "out" / "w.pt", make_model(index))


def test_a_damaged_checkpoint_given_by_path_fails_naming_it(tmp_path, capsys):
    run = make_run(tmp_path, SAVES)
    path = run / "checkpoints" / checkpoint_name("ckpt", 3, 30)
    path.write_bytes(path.read_bytes()[:-64])
    assert export(run, "--checkpoint", path) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"unison export: Checkpoint {path} is truncated or corrupt")
    assert not (run / "model.pt").exists()


def test_an_existing_output_is_replaced_only_with_force(tmp_path, capsys):
    run = make_run(tmp_path, SAVES)
    assert export(run, "--checkpoint", "last") == 0
    capsys.readouterr()
    assert export(run) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"unison export: the output {run / 'model.pt'} (the default): the file exists.")
    assert "--force" in err
    exported(run / "model.pt", make_model(3))  # untouched
    assert export(run, "--force") == 0
    exported(run / "model.pt", make_model(1))


def test_the_ema_average_of_a_real_run_is_exported(tmp_path):
    """A trainer with an EMA and a Checkpoint handler, as ``unison run`` builds them: the
    exported weights are those the model and its average held at each save."""
    run = tmp_path / "run"
    scores = [0.2, 0.8, 0.5]
    model = make_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_trainer(model, optimizer, nn.functional.cross_entropy)
    ema = EMA(model, decay=0.5)
    ema.attach(trainer)

    @trainer.on(Events.EPOCH_COMPLETED)
    def _score(engine):
        engine.state.metrics["acc"] = scores[engine.state.epoch - 1]

    Checkpoint(
        run / "checkpoints", {"model": model, "optimizer": optimizer}, trainer, metric="acc", keep_last=None
    ).attach()
    saved = {}
    trainer.after_epoch(lambda e: saved.update({e.state.epoch: (_copy(model), _copy(ema.module))}))
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, generator=gen), torch.randint(0, 2, (4,), generator=gen)) for _ in range(3)]
    trainer.run(batches, max_epochs=len(scores))
    best = 1 + max(range(len(scores)), key=scores.__getitem__)

    assert export(run, "--ema") == 0
    exported(run / "model-ema.pt", saved[best][1])
    assert export(run) == 0
    exported(run / "model.pt", saved[best][0])
    assert export(run, "--checkpoint", "last", "--ema", "--out", tmp_path / "last.pt") == 0
    exported(tmp_path / "last.pt", saved[len(scores)][1])
    assert not torch.equal(saved[best][0][0].weight, saved[best][1][0].weight)  # the two differ


def _copy(module: nn.Module) -> nn.Module:
    copy = make_model(0)
    copy.load_state_dict(module.state_dict())
    return copy


def test_asking_for_an_average_the_run_did_not_keep_is_a_flag_error(tmp_path, capsys):
    run = make_run(tmp_path, SAVES)
    assert export(run, "--ema") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("unison export: --ema: Checkpoint ") and "holds no EMA average" in err
    assert "leave out --ema" in err


def test_the_run_folder_is_only_read(tmp_path):
    run = make_run(tmp_path, SAVES)
    folder = run / "checkpoints"
    (folder / ".ckpt-e0009-i000000090.pt.tmp").write_bytes(b"a save in flight")  # a run still training
    before = {p.name: p.stat().st_mtime_ns for p in folder.rglob("*")}
    assert export(run, "--checkpoint", "last") == 0 and export(run, "--out", tmp_path / "b.pt") == 0
    assert {p.name: p.stat().st_mtime_ns for p in folder.rglob("*")} == before


def test_checkpoints_missing_from_the_manifest_are_found_on_disk(tmp_path):
    run = make_run(tmp_path, SAVES)
    (run / "checkpoints" / "manifest.json").unlink()
    assert export(run, "--checkpoint", "last") == 0
    exported(run / "model.pt", make_model(3))
    assert export(run, "--out", tmp_path / "best.pt") == 0
    exported(tmp_path / "best.pt", make_model(1))


def test_a_manifest_naming_a_file_outside_its_folder_is_refused(tmp_path, capsys):
    run = make_run(tmp_path, SAVES)
    outside = run / "escape.pt"
    atomic_save(
        {"meta": {"epoch": 9, "iteration": 90}, "objects": {"model": make_model(7).state_dict()}}, outside
    )
    manifest = Manifest(run / "checkpoints")
    manifest.entries = [Entry("../escape.pt", 9, 90, 5.0, sequence=9)]
    manifest.write()
    assert export(run) == 1
    assert "'../escape.pt', which is not a file of the checkpoint folder" in capsys.readouterr().err
    assert not (run / "model.pt").exists()


@pytest.mark.parametrize(
    ("case", "message"),
    [
        (
            "missing",
            "RUN_DIR {arg}: no such folder. Expected a run folder (runs/<name>/<timestamp>) holding checkpoints/",
        ),
        ("no-checkpoints", "RUN_DIR {arg}: not a unison run folder (it holds no checkpoints/ folder)"),
        ("empty", "RUN_DIR {arg}: its checkpoints/ holds no checkpoint"),
        ("file", "RUN_DIR {arg}: this is a file, not a folder."),
        (
            "bad-checkpoint",
            "--checkpoint nope.pt: no such file or folder. Expected 'best', 'last', a checkpoint file",
        ),
        ("out-in-checkpoints", "--out {out}: this is inside the run's checkpoints/ folder"),
        ("out-folder", "--out {out}: this is a folder. Expected a file path"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument_and_the_fix(tmp_path, capsys, case, message):
    run = make_run(tmp_path, SAVES)
    arg, flags, out = run, [], None
    if case == "missing":
        arg = tmp_path / "nowhere"
    elif case == "no-checkpoints":
        arg = tmp_path / "runs"
    elif case == "empty":
        arg = tmp_path / "fresh"
        (arg / "checkpoints").mkdir(parents=True)
    elif case == "file":
        arg = run / "checkpoints" / checkpoint_name("ckpt", 1, 10)
    elif case == "bad-checkpoint":
        flags = ["--checkpoint", "nope.pt"]
    elif case == "out-in-checkpoints":
        out = run / "checkpoints" / "model.pt"
    else:
        out = tmp_path
    if out is not None:
        flags = ["--out", out]
    assert export(arg, *flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("unison export: " + message.format(arg=arg, out=out)), err
    assert not (run / "model.pt").exists()


def test_a_bad_flag_value_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_info:
        export("somewhere", "--mode", "best")
    assert exit_info.value.code == 2
    assert "argument --mode: invalid choice: 'best'" in capsys.readouterr().err


def test_the_command_is_listed(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "export" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["inside a checkpoint", "through a link", "another run's checkpoints"])
def test_an_output_anywhere_inside_checkpoints_is_refused_and_nothing_changes(tmp_path, capsys, where):
    run = make_run(tmp_path, SAVES)
    sharded = run / "checkpoints" / checkpoint_name("ckpt", 2, 20).replace(".pt", ".dcp")
    before = {p.name: p.read_bytes() for p in sharded.iterdir()}
    if where == "inside a checkpoint":
        out = sharded / "rest.pt"
    elif where == "through a link":
        (tmp_path / "link").symlink_to(sharded)
        out = tmp_path / "link" / "rest.pt"
    else:
        other = make_run(tmp_path / "other", SAVES)
        out = other / "checkpoints" / "sub" / "model.pt"
    assert export(run, "--checkpoint", sharded.name, "--out", out, "--force") == 2
    assert "this is inside the run's checkpoints/ folder" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in sharded.iterdir()} == before


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ({"score": "0.5"}, "checkpoints[0].score is '0.5', expected a number or null"),
        ({"epoch": "abc"}, "checkpoints[0].epoch is 'abc', expected an integer >= 0"),
        ({"iteration": [1]}, "checkpoints[0].iteration is [1], expected an integer >= 0"),
        ({"colour": 1}, "checkpoints[0].colour is 1, expected one of the fields file, epoch"),
    ],
)
def test_a_manifest_field_of_another_type_is_named_and_the_folder_read_instead(
    tmp_path, caplog, record, expected
):
    import json

    run = make_run(tmp_path, SAVES)
    manifest = run / "checkpoints" / "manifest.json"
    raw = json.loads(manifest.read_text())
    whole = [
        r["file"] for r in raw["checkpoints"] if r["file"].endswith(".pt")
    ]  # these folders hold no checksums
    raw["checkpoints"][0].update(record)
    manifest.write_text(json.dumps(raw))
    with caplog.at_level("WARNING", logger="unison"):
        assert export(run, "--checkpoint", "last", "--out", tmp_path / "w.pt") == 0
    assert f"{manifest}: {expected}" in caplog.text
    exported(tmp_path / "w.pt", make_model(3))
    with caplog.at_level("WARNING", logger="unison"):
        assert _rebuilt(run) == whole  # rebuilt from the files
    raw["checkpoints"] = {"not": "a list"}
    manifest.write_text(json.dumps(raw))
    assert _rebuilt(run) == whole


def _rebuilt(run: Path) -> list[str]:
    return [e.file for e in Manifest(run / "checkpoints").rebuild().entries]
