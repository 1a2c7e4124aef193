"""Bad configs fail in the launching process, before any rank is spawned.

Every case goes through the real entry points, ``unison.recipe.run(path, nproc=2)`` and
``unison run PATH --nproc 2`` (``unison.cli.main``, in-process), with every way of
starting a process replaced by a function that fails the test. Each error must be a
:class:`ConfigError` whose message starts ``file:line: key.path:`` (``--set K=V: key.path:``
for an override), the line being the one marked ``# <-- here`` in the case's YAML.
"""

from __future__ import annotations

import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.multiprocessing

import unison.distributed.launcher as launcher
import unison.recipe.phases
from unison.cli import main as cli_main
from unison.config import ConfigError

DATA = Path(__file__).parent / "data"
MARK = "# <-- here"
BAIT = "pwned"  # a file that a refused tag would create if it were executed

DATA_MODULE = """\
import torch
from torch.utils.data import TensorDataset


def build(seed, n=16):
    g = torch.Generator().manual_seed(seed)
    ds = TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g))
    return ds, ds
"""

# A valid config: the cases add a section to it (or replace it: `whole=True`). Its data
# module lives next to the config, so resolution goes through the "config's folder" rule.
BASE = """\
name: bad
model:
  type: !pyobject torch.nn.Linear
  kwargs: {in_features: 4, out_features: 2}
data:
  build: !pyobject MODULE.build
"""


class SpawnAttempted(AssertionError):
    """A process was about to be started for a config that should have been refused."""


@dataclass(frozen=True)
class Bad:
    id: str
    text: str
    key: str | None
    needles: tuple[str, ...] = ()
    whole: bool = False


@dataclass(frozen=True)
class BadSet:
    id: str
    sets: tuple[str, ...]
    culprit: str
    key: str | None
    needles: tuple[str, ...] = ()


FILE_CASES = [
    # wrong types
    Bad(
        "batch_size-string",
        'training:\n  batch_size: "32"  # <-- here\n',
        "training.batch_size",
        ("expected int", "'32'"),
    ),
    Bad(
        "max_epochs-float",
        "training:\n  max_epochs: 1.5  # <-- here\n",
        "training.max_epochs",
        ("expected int", "1.5"),
    ),
    Bad("lr-word", "training:\n  lr: abc  # <-- here\n", "training.lr", ("expected float", "'abc'")),
    Bad(
        "pin_memory-string",
        'training:\n  pin_memory: "yes"  # <-- here\n',
        "training.pin_memory",
        ("expected bool",),
    ),
    Bad("amp-fp8", "training:\n  amp: fp8  # <-- here\n", "training.amp", ("'bf16'", "'fp16'", "'fp8'")),
    Bad(
        "backend-mpi",
        "parallel:\n  backend: mpi  # <-- here\n",
        "parallel.backend",
        ("'gloo'", "'nccl'", "'mpi'"),
    ),
    Bad("imports-string", "imports: json  # <-- here\n", "imports", ("a list of str",)),
    # unknown keys, with the nearest valid one
    Bad("unknown-top-level", "trainig:  # <-- here\n  lr: 0.1\n", "trainig", ("Did you mean 'training'?",)),
    Bad(
        "unknown-nested",
        "training:\n  seed: 1\n  lrr: 0.1  # <-- here\n",
        "training.lrr",
        ("Did you mean 'lr'?",),
    ),
    # a section that is a scalar
    Bad("section-scalar", "training: 5  # <-- here\n", "training", ("expected a mapping",)),
    # required keys: the line is that of the section the key is missing from, if any
    Bad(
        "missing-model-type",
        "name: bad\nmodel:  # <-- here\n  kwargs: {in_features: 4}\ndata:\n  build: !pyobject MODULE.build\n",
        "model.type",
        ("required",),
        whole=True,
    ),
    Bad(
        "missing-data-build",
        "name: bad\nmodel:\n  type: !pyobject torch.nn.Linear\n",
        "data.build",
        ("required",),
        whole=True,
    ),
    # !pyobject that cannot be imported
    Bad(
        "pyobject-module-missing",
        "imports: [unison_no_such_module]\n"
        "training:\n  loss: !pyobject unison_no_such_module.loss  # <-- here\n",
        "training.loss",
        ("no module 'unison_no_such_module'",),
    ),
    Bad(
        "pyobject-attribute-missing",
        "training:\n  loss: !pyobject torch.nn.functional.cross_entropyy  # <-- here\n",
        "training.loss",
        ("has no 'cross_entropyy'",),
    ),
    Bad(
        "pyobject-attribute-case",
        "training:\n  optimizer_type: !pyobject torch.optim.Adamw  # <-- here\n",
        "training.optimizer_type",
        ("Did you mean torch.optim.AdamW?",),
    ),
    # refused !pyobject
    Bad(
        "refused-os-system",
        "training:\n  loss: !pyobject os.system  # <-- here\n",
        "training.loss",
        ("refused",),
    ),
    Bad(
        "refused-subprocess",
        "training:\n  loss: !pyobject subprocess.run  # <-- here\n",
        "training.loss",
        ("refused",),
    ),
    Bad(
        "refused-eval",
        "training:\n  loss: !pyobject builtins.eval  # <-- here\n",
        "training.loss",
        ("refused",),
    ),
    Bad(
        "refused-private",
        "training:\n  loss: !pyobject torch._C  # <-- here\n",
        "training.loss",
        ("private",),
    ),
    Bad(
        "refused-outside-allow-list",
        "training:\n  loss: !pyobject unison_not_declared_pkg.loads  # <-- here\n",
        "training.loss",
        ("allow-list", "imports: [unison_not_declared_pkg]"),
    ),
    Bad(
        "refused-stdlib",
        "training:\n  loss: !pyobject json.loads  # <-- here\n",
        "training.loss",
        ("standard library",),
    ),
    Bad(
        "unknown-key-in-model",
        "name: bad\nmodel:\n  type: !pyobject torch.nn.Linear\n  kwarg: {in_features: 4}  # <-- here\n"
        "data:\n  build: !pyobject MODULE.build\n",
        "model.kwarg",
        ("unknown key", "Did you mean 'kwargs'?"),
        whole=True,
    ),
    Bad(
        "refused-nested-kwarg",
        "validation:\n  metrics:\n    loss:\n      type: !pyobject unison.metrics.Loss\n"
        "      kwargs:\n        loss_fn: !pyobject os.system  # <-- here\n",
        "validation.metrics.loss.kwargs.loss_fn",
        ("refused",),
    ),
    # wrong slot types
    Bad(
        "slot-optimizer",
        "training:\n  optimizer_type: !pyobject torch.nn.Linear  # <-- here\n",
        "training.optimizer_type",
        ("torch.optim.Optimizer",),
    ),
    Bad(
        "slot-scheduler",
        "training:\n  scheduler_type: !pyobject torch.optim.SGD  # <-- here\n",
        "training.scheduler_type",
        ("torch.optim.lr_scheduler.LRScheduler",),
    ),
    Bad(
        "slot-loss-not-callable",
        "training:\n  loss: !pyobject torch.float32  # <-- here\n",
        "training.loss",
        ("found a dtype (torch.float32)", "training.loss accepts"),
    ),
    Bad(
        "slot-metric",
        "validation:\n  metrics:\n    acc: !pyobject torch.nn.Linear  # <-- here\n",
        "validation.metrics.acc",
        ("found class torch.nn", "accepts an ignite.metrics.Metric subclass"),
    ),
    Bad(
        "slot-model",
        "model:\n  type: !pyobject torch.optim.SGD  # <-- here\ndata:\n  build: !pyobject MODULE.build\n",
        "model.type",
        ("torch.nn.Module",),
        whole=True,
    ),
    # Python tags: refused by the loader, never executed
    Bad(
        "tag-python-apply",
        'training:\n  loss: !!python/object/apply:os.system ["touch BAIT"]  # <-- here\n',
        None,
        ("Python tags are refused", "!pyobject"),
    ),
    Bad(
        "tag-python-apply-open",
        'training:\n  loss: !!python/object/apply:builtins.open ["BAIT", "w"]  # <-- here\n',
        None,
        ("Python tags are refused",),
    ),
    Bad(
        "tag-python-name",
        "training:\n  loss: !!python/name:os.system  # <-- here\n",
        None,
        ("Python tags are refused",),
    ),
    # not YAML, not a mapping, !pyobject on a mapping
    Bad("yaml-syntax", "training:\n  lr: 0.1: 2  # <-- here\n", None, ("YAML syntax error",)),
    Bad(
        "top-level-list",
        "- name: x  # <-- here\n- training: {}\n",
        None,
        ("a mapping of sections", "list"),
        whole=True,
    ),
    Bad(
        "pyobject-on-mapping",
        "training:\n  loss: !pyobject {path: os.system}  # <-- here\n",
        None,
        ("dotted path",),
    ),
    # values out of range
    Bad(
        "batch_size-zero", "training:\n  batch_size: 0  # <-- here\n", "training.batch_size", ("must be > 0",)
    ),
    Bad(
        "accumulation-zero",
        "training:\n  accumulation_steps: 0  # <-- here\n",
        "training.accumulation_steps",
        ("must be > 0",),
    ),
    Bad("lr-negative", "training:\n  lr: -0.1  # <-- here\n", "training.lr", ("must be > 0",)),
    Bad("lr-nan", "training:\n  lr: .nan  # <-- here\n", "training.lr", ("must be > 0 and finite", "nan")),
    Bad(
        "every_seconds-inf",
        "checkpoint:\n  every_seconds: .inf  # <-- here\n",
        "checkpoint.every_seconds",
        ("must be > 0 and finite", "inf", "leave the key out"),
    ),
    Bad(
        "num_workers-negative",
        "training:\n  num_workers: -1  # <-- here\n",
        "training.num_workers",
        ("must be >= 0",),
    ),
    Bad(
        "validation-num_workers-negative",
        "validation:\n  num_workers: -1  # <-- here\n",
        "validation.num_workers",
        ("must be >= 0",),
    ),
    Bad(
        "prefetch-without-workers",
        "training:\n  prefetch_factor: 2  # <-- here\n",
        "training.prefetch_factor",
        ("num_workers",),
    ),
    # an alias and its key both set
    Bad(
        "alias-twice",
        "training:\n  max_epochs: 3\n  num_epochs: 4  # <-- here\n",
        "training.num_epochs",
        ("set twice", "max_epochs"),
    ),
    # parallel.fault_tolerance: values no quorum runs with, settings groups cannot agree on
    Bad(
        "ft-lighthouse-no-scheme",
        "parallel:\n  fault_tolerance:\n    lighthouse: lighthouse-host:29510  # <-- here\n",
        "parallel.fault_tolerance.lighthouse",
        ("http://host:port", "'lighthouse-host:29510'", "torchft_lighthouse"),
    ),
    Bad(
        "ft-replica-id-out-of-range",
        "parallel:\n  fault_tolerance:\n    lighthouse: http://h:29510\n    replica_groups: 2\n    replica_id: 2  # <-- here\n",
        "parallel.fault_tolerance.replica_id",
        ("0 .. replica_groups-1 = 1", "got 2"),
    ),
    Bad(
        "ft-min-replicas-above-groups",
        "parallel:\n  fault_tolerance:\n    lighthouse: http://h:29510\n    min_replicas: 3  # <-- here\n",
        "parallel.fault_tolerance.min_replicas",
        ("1 .. replica_groups = 2", "got 3"),
    ),
    Bad(
        "ft-quorum-timeout-zero",
        "parallel:\n  fault_tolerance:\n    lighthouse: http://h:29510\n    quorum_timeout: 0  # <-- here\n",
        "parallel.fault_tolerance.quorum_timeout",
        ("> 0",),
    ),
    Bad(
        "ft-with-accumulation",
        "training:\n  accumulation_steps: 2  # <-- here\nparallel:\n  fault_tolerance:\n    lighthouse: http://h:29510\n",
        "training.accumulation_steps",
        ("parallel.fault_tolerance", "one batch per committed step"),
    ),
    Bad(
        "ft-with-fp16",
        "training:\n  amp: fp16  # <-- here\nparallel:\n  fault_tolerance:\n    lighthouse: http://h:29510\n",
        "training.amp",
        ("parallel.fault_tolerance", "loss scaler"),
    ),
]

# -- the threat model (docs/configuration.md, "What a config can and cannot do") -------------------

# 1. typed slots: a callable that writes files or runs commands is refused in the model slot,
# naming what was found and what the slot accepts.
WRITERS = (
    ("torch.utils.collect_env.run", "function torch.utils.collect_env.run"),
    ("unison.checkpoint.io.atomic_write_json", "function unison.checkpoint.io.atomic_write_json"),
    ("ignite.utils.setup_logger", "function ignite.utils.setup_logger"),
    ("torch.from_file", "built-in function"),
    ("torch.onnx.export", "function torch.onnx"),
    ("unison.checkpoint.atomic_save", "function unison.checkpoint"),
)
THREAT_CASES = [
    Bad(
        f"model-slot-{path}",
        f"name: bad\nmodel:\n  type: !pyobject {path}  # <-- here\n  kwargs: {{filepath: BAIT}}\n"
        "data:\n  build: !pyobject MODULE.build\n",
        "model.type",
        (found, "model.type accepts a torch.nn.Module subclass"),
        whole=True,
    )
    for path, found in WRITERS
] + [
    Bad(
        "hook-slot-torch-function",
        "hooks:\n  after_training: !pyobject torch.utils.collect_env.run  # <-- here\n",
        "hooks.after_training",
        ("function torch.utils.collect_env.run", "a function of your own modules"),
    ),
    Bad(
        "data-slot-torch-function",
        "name: bad\nmodel:\n  type: !pyobject torch.nn.Linear\n  kwargs: {in_features: 4, out_features: 2}\n"
        "data:\n  build: !pyobject torch.utils.data.random_split  # <-- here\n",
        "data.build",
        ("function torch.utils.data", "a function of your own modules"),
        whole=True,
    ),
    Bad(
        "data-slot-dataset-class",
        "name: bad\nmodel:\n  type: !pyobject torch.nn.Linear\n  kwargs: {in_features: 4, out_features: 2}\n"
        "data:\n  build: !pyobject torch.utils.data.TensorDataset  # <-- here\n",
        "data.build",
        ("class torch.utils.data", "a Dataset class builds one dataset"),
        whole=True,
    ),
    Bad(
        "loss-slot-logger",
        "training:\n  loss: !pyobject ignite.utils.setup_logger  # <-- here\n",
        "training.loss",
        ("function ignite.utils.setup_logger", "training.loss accepts"),
    ),
    Bad(
        "value-in-model-kwargs",
        "name: bad\nmodel:\n  type: !pyobject torch.nn.Linear\n  kwargs:\n    in_features: 4\n"
        "    out_features: !pyobject torch.utils.collect_env.run  # <-- here\n"
        "data:\n  build: !pyobject MODULE.build\n",
        "model.kwargs.out_features",
        ("function torch.utils.collect_env.run", "inside model args and kwargs", "nothing that runs commands"),
        whole=True,
    ),
    Bad(
        "value-in-metric-kwargs",
        "validation:\n  metrics:\n    loss:\n      type: !pyobject unison.metrics.Loss\n"
        "      kwargs:\n        loss_fn: !pyobject unison.checkpoint.atomic_save  # <-- here\n",
        "validation.metrics.loss.kwargs.loss_fn",
        ("function unison.checkpoint", "inside kwargs"),
    ),
    Bad(
        "metric-that-downloads",
        "validation:\n  metrics:\n    fid: !pyobject ignite.metrics.FID  # <-- here\n",
        "validation.metrics.fid",
        ("FID",),
    ),
    # 2. imports: names the user's own code; stdlib and loaders are refused where they are named
    *[
        Bad(
            f"imports-{module}",
            f"imports: [{module}]  # <-- here\n",
            "imports.0",
            ("refused", module.split(".")[0]),
        )
        for module in (
            "timeit",
            "cProfile",
            "pdb",
            "asyncio",
            "shelve",
            "logging.config",
            "pydoc",
            "webbrowser",
            "urllib",
            "yaml",
            "numpy",
            "joblib",
            "pickle",
            "torch",
            "unison.checkpoint",
        )
    ],  # fmt: skip
    *[
        Bad(
            f"unreachable-{path}",
            f"hooks:\n  after_training: !pyobject {path}  # <-- here\n",
            "hooks.after_training",
            ("refused",),
        )
        for path in (
            "timeit.timeit",
            "cProfile.run",
            "pdb.run",
            "asyncio.run",
            "shelve.open",
            "logging.config.listen",
            "pydoc.pipepager",
            "webbrowser.open",
            "urllib.request.urlretrieve",
            "yaml.unsafe_load",
        )
    ],  # fmt: skip
    # 5. duplicate keys and sections, naming both lines
    Bad(
        "duplicate-key",
        "training:\n  lr: 0.1\n  lr: 0.2  # <-- here\n",
        "training.lr",
        ("set twice", "lines 8 and 9"),
    ),
    Bad(
        "duplicate-section",
        "training:\n  seed: 1\ntraining:  # <-- here\n  seed: 2\n",
        "training",
        ("set twice", "lines 7 and 9"),
    ),
    # 6. a name that would leave logging.root
    *[
        Bad(
            f"name-{i}",
            BASE.replace("name: bad", f"name: {name}  # <-- here"),
            "name",
            ("not a folder name",),
            True,
        )
        for i, name in enumerate(["../escape", "/tmp/abs", "a/b", "'..'", "'~x'"])
    ],
    # 7. a mode that contradicts a loss-like metric
    Bad(
        "mode-max-on-default-loss",
        "checkpoint:\n  mode: max  # <-- here\n",
        "checkpoint.mode",
        ("'loss'", "mode: min"),
    ),
    Bad(
        "mode-max-on-val-loss",
        "validation:\n  metrics:\n    val_loss: !pyobject unison.metrics.Loss\n"
        "early_stopping:\n  patience: 2\n  mode: max  # <-- here\n",
        "early_stopping.mode",
        ("'val_loss'", "mode: min"),
    ),
    Bad(
        "mode-min-on-accuracy",
        "validation:\n  metrics:\n    accuracy: !pyobject unison.metrics.Accuracy\n"
        "checkpoint:\n  mode: min  # <-- here\n",
        "checkpoint.mode",
        ("'accuracy'", "mode: max"),
    ),
    # 8. mistakes that used to fail only after the ranks started
    Bad(
        "model-kwargs-typo",
        "name: bad\nmodel:\n  type: !pyobject torch.nn.Linear\n  kwargs:\n    in_features: 4\n"
        "    out_feature: 2  # <-- here\ndata:\n  build: !pyobject MODULE.build\n",
        "model.kwargs.out_feature",
        ("no argument 'out_feature'", "Did you mean 'out_features'?"),
        whole=True,
    ),
    Bad(
        "model-kwargs-missing",
        "name: bad\nmodel:\n  type: !pyobject torch.nn.Linear  # <-- here\n  kwargs: {in_features: 4}\n"
        "data:\n  build: !pyobject MODULE.build\n",
        "model.type",
        ("'out_features'", "model.kwargs"),
        whole=True,
    ),
    Bad(
        "model-kwargs-non-string-key",
        "name: bad\nmodel:\n  type: !pyobject torch.nn.Linear\n  kwargs:\n    in_features: 4\n"
        "    out_features: 2\n    1: 2  # <-- here\ndata:\n  build: !pyobject MODULE.build\n",
        "model.kwargs.1",
        ("int 1",),
        whole=True,
    ),
    Bad(
        "model-fails-on-meta",
        "name: bad\nmodel:\n  type: !pyobject torch.nn.Linear\n  kwargs:  # <-- here\n"
        "    in_features: -4\n    out_features: 2\ndata:\n  build: !pyobject MODULE.build\n",
        "model.kwargs",
        ("negative dimension",),
        whole=True,
    ),
    Bad(
        "optimizer-kwargs-typo",
        "training:\n  optimizer_kwargs:\n    lrr: 0.1  # <-- here\n",
        "training.optimizer_kwargs.lrr",
        ("no argument 'lrr'", "Did you mean 'lr'?"),
    ),
    Bad(
        "optimizer-kwargs-bad-value",
        "training:\n  optimizer_kwargs:  # <-- here\n    betas: [0.9, 2.0]\n",
        "training.optimizer_kwargs",
        ("beta",),
    ),
    Bad(
        "scheduler-kwargs-typo",
        "training:\n  scheduler_type: !pyobject torch.optim.lr_scheduler.StepLR\n"
        "  scheduler_kwargs:\n    step_sise: 2  # <-- here\n",
        "training.scheduler_kwargs.step_sise",
        ("Did you mean 'step_size'?",),
    ),
    Bad(
        "metric-kwargs-typo",
        "validation:\n  metrics:\n    acc:\n      type: !pyobject unison.metrics.Accuracy\n"
        "      kwargs:\n        topk: 2  # <-- here\n",
        "validation.metrics.acc.kwargs.topk",
        ("Did you mean 'top_k'?",),
    ),
    Bad(
        "loss-class-needing-arguments",
        "training:\n  loss: !pyobject torch.nn.Bilinear  # <-- here\n",
        "training.loss",
        ("needs arguments", "instance"),
    ),
    Bad(
        "data-build-kwargs-typo",
        BASE + "  kwargs:\n    nn: 3  # <-- here\n",
        "data.kwargs.nn",
        ("no argument 'nn'", "Did you mean 'n'?"),
        whole=True,
    ),
    Bad(
        "logging-root-under-a-file",
        "logging:\n  root: FOLDER/MODULE.py/runs  # <-- here\n",
        "logging.root",
        ("is a file, not a folder",),
    ),
    Bad(
        "device-not-here",
        "training:\n  device: cuda:7  # <-- here\n",
        "training.device",
        ("'cuda:7'",),
    ),
]

FIXTURE_CASES = [
    # (file in tests/config/data, key path, needles)
    ("bad_syntax.yaml", None, ("YAML syntax error",)),
    ("top_level_list.yaml", None, ("a mapping of sections",)),
    ("unknown_top_level.yaml", "trainig", ("Did you mean 'training'?",)),
]

# Bad configs that still get past the launching process today (bugs, see each reason).
FILE_CASES_LATE = [
    pytest.param(
        Bad(
            "metric-not-a-pyobject",
            "validation:\n  metrics:\n    acc: accuracy  # <-- here\n",
            "validation.metrics.acc",
            ("!pyobject",),
        ),
        id="metric-not-a-pyobject",
    ),
    pytest.param(
        Bad(
            "checkpoint-metric-unknown",
            "validation:\n  metrics:\n    acc: !pyobject unison.metrics.Accuracy\n"
            "checkpoint:\n  metric: accuracy  # <-- here\n",
            "checkpoint.metric",
            ("'acc'",),
        ),
        id="checkpoint-metric-unknown",
    ),
    pytest.param(
        Bad(
            "early-stopping-metric-unknown",
            "validation:\n  metrics:\n    acc: !pyobject unison.metrics.Accuracy\n"
            "early_stopping:\n  patience: 2\n  metric: accuracy  # <-- here\n",
            "early_stopping.metric",
            ("'acc'",),
        ),
        id="early-stopping-metric-unknown",
    ),
]

SET_CASES = [
    BadSet("no-equals", ("training.batch_size",), "training.batch_size", None, ("KEY.PATH=VALUE",)),
    BadSet("empty-key-part", ("training..lr=1",), "training..lr=1", None, ("KEY.PATH=VALUE",)),
    BadSet(
        "crosses-a-scalar",
        ("training.seed.x=1",),
        "training.seed.x=1",
        None,
        ("training.seed.x", "training.seed is a int, not a section"),
    ),
    BadSet(
        "wrong-type",
        ("training.batch_size=abc",),
        "training.batch_size=abc",
        "training.batch_size",
        ("expected int",),
    ),
    BadSet(
        "later-bad-one-named",
        ("training.batch_size=8", "training.batch_size=0"),
        "training.batch_size=0",
        "training.batch_size",
        ("must be > 0",),
    ),
    BadSet("unknown-key", ("training.lrr=0.1",), "training.lrr=0.1", "training.lrr", ("Did you mean 'lr'?",)),
    BadSet(
        "refused-pyobject",
        ("training.loss=!pyobject os.system",),
        "training.loss=!pyobject os.system",
        "training.loss",
        ("refused",),
    ),
    BadSet(
        "python-tag",
        ('training.loss=!!python/object/apply:os.system ["touch BAIT"]',),
        'training.loss=!!python/object/apply:os.system ["touch BAIT"]',
        None,
        ("python/object/apply",),
    ),
    BadSet("invalid-yaml", ("training.lr=[1, 2",), "training.lr=[1, 2", None, ("not valid YAML",)),
    BadSet("section-scalar", ("model=5",), "model=5", "model", ("expected a mapping",)),
    BadSet("required-unset", ("model.type=null",), "model.type=null", "model.type", ("required",)),
]

# Errors whose origin is an override but which are reported against the file (bugs).
SET_CASES_MISATTRIBUTED = [
    BadSet(
        "creates-section-under-a-leaf",
        ("training.batch_size.x=1",),
        "training.batch_size.x=1",
        "training.batch_size",
        ("expected int",),
    ),
    BadSet(
        "unknown-section", ("trainig.lr=0.1",), "trainig.lr=0.1", "trainig", ("Did you mean 'training'?",)
    ),
    BadSet(
        "pyobject-on-mapping",
        ("training.loss=!pyobject {a: 1}",),
        "training.loss=!pyobject {a: 1}",
        None,
        ("dotted path",),
    ),
]


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture
def no_spawn(monkeypatch):
    """Every way `run` could start a process fails the test; returns the attempts."""
    attempts: list[str] = []

    def refuse(name):
        def fail(*args, **kwargs):
            attempts.append(name)
            raise SpawnAttempted(f"{name} was called: a process was about to start")

        return fail

    monkeypatch.setattr(launcher, "_spawn", refuse("unison.distributed.launcher._spawn"))
    monkeypatch.setattr(
        torch.multiprocessing, "start_processes", refuse("torch.multiprocessing.start_processes")
    )
    monkeypatch.setattr(torch.multiprocessing, "spawn", refuse("torch.multiprocessing.spawn"))
    return attempts


@pytest.fixture
def module_name(monkeypatch):
    """A unique name for the config's data module; sys.path and sys.modules are restored."""
    name = f"bad_cfg_data_{uuid.uuid4().hex[:10]}"
    monkeypatch.setattr(sys, "path", list(sys.path))  # resolve() adds the config's folder
    yield name
    sys.modules.pop(name, None)


def _write(case: Bad, folder: Path, module: str) -> tuple[Path, int | None]:
    text = case.text if case.whole else BASE + case.text
    text = text.replace("MODULE", module).replace("BAIT", str(folder / BAIT)).replace("FOLDER", str(folder))
    (folder / f"{module}.py").write_text(DATA_MODULE)
    path = folder / f"{case.id}.yaml"
    path.write_text(text)
    marked = [i for i, line in enumerate(text.splitlines(), 1) if MARK in line]
    assert len(marked) <= 1, f"case {case.id} marks more than one line"
    return path, (marked[0] if marked else None)


def _expected_prefix(file: str, line: int | None, key: str | None) -> str:
    where = file + (f":{line}" if line is not None else "")
    return where + (f": {key}" if key else "") + ": "


def _run(entry: str, path: str, sets: tuple[str, ...], capsys) -> str:
    """Runs a config through `entry`; returns the error text (ConfigError or stderr)."""
    if entry == "api":
        with pytest.raises(ConfigError) as info:
            unison.recipe.run(path, nproc=2, overrides=list(sets))
        return str(info.value)
    argv = ["run", path, "--nproc", "2"]
    for item in sets:
        argv += ["--set", item]
    rc = cli_main(argv)
    err = capsys.readouterr().err
    assert rc == 2, f"`unison {' '.join(argv)}` returned {rc}, not 2; stderr:\n{err}"
    assert err.startswith("unison run: "), err
    return err[len("unison run: ") :]


# -- the guard itself -----------------------------------------------------------------------


def test_the_guard_sees_a_spawn_of_a_good_config(tmp_path, no_spawn, module_name):
    """The base config is valid: run() gets as far as spawning, which the guard reports."""
    path, _ = _write(Bad("good", "", None), tmp_path, module_name)
    with pytest.raises(SpawnAttempted):
        unison.recipe.run(str(path), nproc=2)
    assert no_spawn == ["unison.distributed.launcher._spawn"]


# -- file-borne errors ----------------------------------------------------------------------


@pytest.mark.parametrize("entry", ["api", "cli"])
@pytest.mark.parametrize(
    "case",
    [pytest.param(c, id=c.id) for c in FILE_CASES + THREAT_CASES]
    + [
        pytest.param(
            Bad(
                "nccl-without-cuda",
                "parallel:\n  backend: nccl  # <-- here\n",
                "parallel.backend",
                ("CUDA", "gloo"),
            ),
            id="nccl-without-cuda",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA"),
        ),
    ],
)
def test_bad_config_fails_before_spawning(case, entry, tmp_path, no_spawn, module_name, capsys):
    path, line = _write(case, tmp_path, module_name)
    message = _run(entry, str(path), (), capsys)
    assert message.startswith(_expected_prefix(str(path), line, case.key)), message
    for needle in case.needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    assert no_spawn == []
    assert not list(tmp_path.glob(BAIT + "*")), "a refused tag was executed"


@pytest.mark.parametrize("entry", ["api", "cli"])
@pytest.mark.parametrize("name, key, needles", FIXTURE_CASES, ids=[c[0] for c in FIXTURE_CASES])
def test_bad_fixture_file_fails_before_spawning(name, key, needles, entry, no_spawn, capsys):
    path = DATA / name
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if MARK in text)
    message = _run(entry, str(path), (), capsys)
    assert message.startswith(_expected_prefix(str(path), line, key)), message
    for needle in needles:
        assert needle in message
    assert no_spawn == []


def test_refused_tag_is_not_executed_even_where_it_would_run_first(tmp_path, no_spawn):
    """A Python tag in the first key of the file, read by the CLI: nothing is created."""
    bait = tmp_path / BAIT
    path = tmp_path / "first.yaml"
    path.write_text(f'name: !!python/object/apply:os.system ["touch {bait}"]\n')
    assert cli_main(["run", str(path)]) == 2
    assert not bait.exists()
    assert no_spawn == []


# Errors raised while reading YAML know the line but not the key; the key path is known
# from the document's nodes, and the style guide asks for it.
@pytest.mark.parametrize(
    "text, key",
    [
        pytest.param(
            'training:\n  loss: !!python/object/apply:os.system ["true"]\n', "training.loss", id="python-tag"
        ),
        pytest.param(
            "training:\n  loss: !pyobject {path: os.system}\n", "training.loss", id="pyobject-on-mapping"
        ),
    ],
)
def test_loader_errors_name_the_key_path(text, key, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        unison.recipe.run(str(path), nproc=2)
    assert info.value.key_path == key, str(info.value)


# -- override-borne errors ------------------------------------------------------------------


@pytest.mark.parametrize("entry", ["api", "cli"])
@pytest.mark.parametrize("case", SET_CASES, ids=[c.id for c in SET_CASES])
def test_bad_override_fails_before_spawning(case, entry, tmp_path, no_spawn, module_name, capsys):
    path, _ = _write(Bad(case.id, "training:\n  seed: 3\n", None), tmp_path, module_name)
    sets = tuple(s.replace("BAIT", str(tmp_path / BAIT)) for s in case.sets)
    culprit = case.culprit.replace("BAIT", str(tmp_path / BAIT))
    message = _run(entry, str(path), sets, capsys)
    assert message.startswith(f"--set {culprit}: " + (f"{case.key}: " if case.key else "")), message
    for needle in case.needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    assert no_spawn == []
    assert not list(tmp_path.glob(BAIT + "*")), "a refused tag was executed"


@pytest.mark.parametrize("case", SET_CASES_MISATTRIBUTED, ids=[c.id for c in SET_CASES_MISATTRIBUTED])
def test_override_errors_name_the_override(case, tmp_path, no_spawn, module_name):
    path, _ = _write(Bad(case.id, "", None), tmp_path, module_name)
    with pytest.raises(ConfigError) as info:
        unison.recipe.run(str(path), nproc=2, overrides=list(case.sets))
    message = str(info.value)
    for needle in case.needles:
        assert needle in message
    assert no_spawn == []
    assert message.startswith(f"--set {case.culprit}: "), message


@pytest.mark.parametrize("case", FILE_CASES_LATE)
def test_bad_config_fails_before_spawning_known_bugs(case, tmp_path, no_spawn, module_name, capsys):
    path, line = _write(case, tmp_path, module_name)
    message = _run("api", str(path), (), capsys)
    assert message.startswith(_expected_prefix(str(path), line, case.key)), message
    for needle in case.needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    assert no_spawn == []
