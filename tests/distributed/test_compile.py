"""``torch.compile`` through ``prepare_model(compile=...)`` and ``training.compile``.

The truth for a compiled run is the same run uncompiled (DESIGN rule 9): the parameters
agree to float tolerance (inductor's fused kernels sum in another order), and a run saved
with compile resumes without it, and the other way round, to the uninterrupted run's
parameters. Checkpoints hold the plain module's keys either way.

One compiled run is part of the CI suite (``slow``: DDP at 2 ranks, 11 s with a warm
inductor cache and about 35 s cold here, nearly all of it compilation). The rest compiles
more (FSDP2, fullgraph, dynamic shapes, DDP's graph split, the digits recipe) and runs only
when asked for: ``pytest -m compile``.
The rank functions are in ``_compile_workers.py``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from _compile_workers import (
    compile_and_resume,
    conv_pool_gradient_gaps,
    ddp_graph_splits,
    ddp_options,
    fsdp_compiled,
    torch_class_compiles,
)
from _ddp_workers import make_mlp

import unison.distributed.launcher as launcher
import unison.recipe.phases
from unison.checkpoint.state import load_model_state, model_state
from unison.config import ConfigError
from unison.distributed import prepare_model, unwrap_model
from unison.distributed.compile import compile_model, compile_spec, is_compiled, torch_compile_kwargs
from unison.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max())


# --- in the CI suite ----------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compiled_ddp_trains_like_eager_and_resumes_with_or_without_compile(tmp_path):
    """2 gloo ranks, DDP, 6 iterations of an MLP; runs stopped after iteration 4 and resumed."""
    results = run_distributed(compile_and_resume, str(tmp_path), 4, nproc=2, timeout=270)
    for rank, r in enumerate(results):
        assert r["is_compiled"], f"rank {rank}"
        assert r["graphs"] >= 1, f"rank {rank}: dynamo captured no graph: the model ran uncompiled"
        assert _gap(r["compiled"], r["eager"]) < TOLERANCE, f"rank {rank}"
        assert _gap(r["compiled_to_eager"], r["eager"]) < TOLERANCE, (
            f"rank {rank}: saved compiled, resumed eager"
        )
        assert _gap(r["eager_to_compiled"], r["eager"]) < TOLERANCE, (
            f"rank {rank}: saved eager, resumed compiled"
        )
        assert r["saved_keys"] == r["plain_keys"], "a compiled run's checkpoint holds other keys"
        assert r["user_compiled_keys"] == r["plain_keys"], "torch.compile(model) under DDP: prefixed keys"
        assert _gap(r["eager"], results[0]["eager"]) == 0.0  # every rank holds the same model
    # the data reached the weights: a run is not its own starting point
    assert _gap(results[0]["eager"], torch.cat([p.reshape(-1) for p in make_mlp().parameters()])) > 1e-2


def test_a_model_compiled_by_the_user_saves_plain_keys():
    """``torch.compile(model)`` passed in: unwrap_model and the checkpoint state strip ``_orig_mod.``."""
    plain = make_mlp()
    model = prepare_model(torch.compile(plain))  # one process: no DDP, the OptimizedModule as is
    assert unwrap_model(model) is plain
    assert list(model_state(model)) == list(plain.state_dict())
    other = make_mlp(seed=1)
    load_model_state(model, other.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), other.parameters(), strict=True))


def test_prepare_model_refuses_to_compile_a_compiled_model():
    with pytest.raises(ValueError, match="already compiled"):
        prepare_model(torch.compile(make_mlp()), compile=True)
    model = compile_model(make_mlp())
    with pytest.raises(ValueError, match="already compiled"):
        compile_model(model)


def test_compile_is_in_place_and_a_copy_is_plain():
    plain = make_mlp()
    keys = list(plain.state_dict())
    model = prepare_model(plain, compile={"mode": "default"})  # compiles at the first forward: none here
    assert model is plain and type(model) is torch.nn.Sequential and is_compiled(model)
    assert list(model_state(model)) == keys
    assert not is_compiled(copy.deepcopy(model)), "a copy (EMA, a saved module) would share the compiled call"
    assert not is_compiled(prepare_model(make_mlp(), compile=False))


@pytest.mark.parametrize(
    "value, needle",
    [
        ({"mode": "bogus"}, "compile.mode='bogus'"),
        ({"modes": "default"}, "unknown key(s) ['modes']"),
        ({"fullgraph": "yes"}, "compile.fullgraph='yes'"),
        ({"dynamic": 1}, "compile.dynamic=1"),
        ("sometimes", "compile='sometimes'"),
    ],
)
def test_compile_spec_names_the_bad_key(value, needle):
    with pytest.raises(ValueError) as info:
        compile_spec(value)
    assert needle in str(info.value)


def test_cpu_inductor_options_keep_the_mode():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert torch_compile_kwargs({}, cpu) == {"options": {"reorder_for_peak_memory": False}}
    assert torch_compile_kwargs({"mode": "default", "dynamic": True}, cpu) == {
        "dynamic": True,
        "options": {"reorder_for_peak_memory": False},
    }
    assert torch_compile_kwargs({"mode": "reduce-overhead"}, cuda) == {"mode": "reduce-overhead"}
    assert torch_compile_kwargs({"backend": "aot_eager"}, cpu) == {"backend": "aot_eager"}


CONFIG = """\
name: c
model:
  type: !pyobject torch.nn.Linear
  kwargs: {in_features: 4, out_features: 2}
data:
  build: !pyobject torch.utils.data.TensorDataset
training:
  compile:
    fullgraph: true
    mode: bogus
"""


def test_a_bad_compile_mode_in_a_config_names_file_line_and_key(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a rank was about to be spawned for a config that should have been refused")

    monkeypatch.setattr(launcher, "_spawn", refuse)
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG)
    with pytest.raises(ConfigError) as info:
        unison.recipe.run(str(path), nproc=2)
    message = str(info.value)
    assert message.startswith(f"{path}:10: training.compile.mode: "), message
    assert "'bogus'" in message and "'max-autotune'" in message
    with pytest.raises(ConfigError) as info:
        unison.recipe.run(str(path), nproc=2, overrides=["training.compile.mode=fast"])
    assert str(info.value).startswith("--set training.compile.mode=fast: training.compile.mode: "), info.value


# --- behind the compile marker: pytest -m compile ------------------------------------------------


@pytest.mark.compile
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fsdp_with_compile_trains_to_the_uncompiled_parameters():
    for rank, r in enumerate(run_distributed(fsdp_compiled, 4, nproc=2, timeout=270)):
        assert r["graphs"] >= 1, f"rank {rank}: nothing was compiled"
        assert r[True].keys() == r[False].keys()
        assert max(_gap(r[True][k], r[False][k]) for k in r[True]) < TOLERANCE, f"rank {rank}"


@pytest.mark.compile
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_fullgraph_and_dynamic_under_ddp():
    for rank, r in enumerate(run_distributed(ddp_options, 6, nproc=2, timeout=370)):
        assert _gap(r["fullgraph"], r["eager"]) < TOLERANCE, f"rank {rank}"
        assert _gap(r["dynamic"], r["eager_uneven"]) < TOLERANCE, f"rank {rank}"
        assert r["fullgraph_graphs"] >= 1
        assert r["dynamic_graphs"] == 1, "dynamic=True compiled again for the batch of 3 rows"
        # what compiling the wrapper would do: DDP's forward breaks the graph
        assert r["torch_compile_of_ddp_fullgraph"] != "ran"


@pytest.mark.compile
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_graph_split_at_ddp_buckets_is_torch_compiles():
    """DDP's optimizer splits the captured graph at the gradient buckets as it does for
    ``torch.compile(ddp_model)``; for a model of torch's own classes it does, where
    ``torch.compile(ddp_model)`` captures nothing at all."""
    cases = [("user", "unison"), ("user", "torch"), ("torch", "unison"), ("torch", "torch")]
    for r in run_distributed(ddp_graph_splits, cases, nproc=2, timeout=370):
        ours, theirs = r["user/unison"], r["user/torch"]
        assert ours["buckets_per_graph"] == theirs["buckets_per_graph"] == [3]
        assert ours["graphs"] == theirs["graphs"] == 1
        assert ours["frames_tried"] < theirs["frames_tried"]  # DDP's own code is not attempted
        assert r["torch/unison"]["buckets_per_graph"] == [3]
        assert r["torch/torch"]["graphs"] == 0  # torch's behaviour; if this fails, torch fixed it


@pytest.mark.compile
@pytest.mark.timeout(300)
def test_a_torch_class_is_compiled():
    """``nn.Module.compile`` on an ``nn.Sequential`` captures nothing (torch 2.13); ``compile_model`` does."""
    (counts,) = run_distributed(torch_class_compiles, nproc=1, timeout=270)
    assert counts == {"module.compile": 0, "compile_model": 1}


@pytest.mark.compile
@pytest.mark.timeout(300)
def test_conv_maxpool_gradients_are_eager_ones_on_the_cpu():
    """The digits network's first gradients, compiled, equal eager ones; plain ``torch.compile``
    zeroes the convolutions' gradients on this torch. If the second assert fails, torch fixed
    it and ``_CPU_INDUCTOR_OPTIONS`` in unison/distributed/compile.py may go."""
    (gaps,) = run_distributed(conv_pool_gradient_gaps, nproc=1, timeout=270)
    assert gaps["unison"] < 1e-5
    assert gaps["torch"] > 1e-2


def _recipe(root: Path, *sets: str) -> dict:
    argv = ["run", str(ROOT / "recipes" / "digits" / "config.yaml"), "--nproc", "2"]
    for item in ("logging.progress=false", f"logging.root={root}", *sets):
        argv += ["--set", item]
    assert unison.cli.main(argv) == 0, argv
    (run_dir,) = (root / "digits").iterdir()
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.mark.compile
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_the_digits_recipe_with_compile_reaches_the_uncompiled_accuracy(tmp_path):
    """``unison run recipes/digits/config.yaml --nproc 2 --set training.compile=true`` against the same run without."""
    eager = _recipe(tmp_path / "eager")
    compiled = _recipe(tmp_path / "compiled", "training.compile=true")
    for section in ("validation", "test"):
        assert abs(compiled[section]["accuracy"] - eager[section]["accuracy"]) <= 0.01, (
            section,
            compiled,
            eager,
        )
    best = [max(h["val_accuracy"] for h in run["history"]) for run in (eager, compiled)]
    assert abs(best[0] - best[1]) <= 0.01, best
