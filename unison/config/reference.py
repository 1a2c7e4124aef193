"""The configuration reference (``docs/configuration.md``), generated from the schema."""

from __future__ import annotations

from unison.config.loader import PyObjectRef
from unison.config.resolve import SLOTS
from unison.config.schema import _type_name
from unison.config.schema_walk import walk_keys


def schema_reference() -> list[tuple[str, str, str, str]]:
    """(key path, type, default, doc) for every key: the configuration reference."""
    rows: list[tuple[str, str, str, str]] = []
    for key in walk_keys():
        if key.is_section:  # a whole section: its keys follow
            continue
        doc = key.doc + (f" (also read as `{key.alias}`)" if key.alias else "")
        default = str(key.default) if isinstance(key.default, PyObjectRef) else repr(key.default)
        rows.append((".".join(key.path), _type_name(key.type), default, doc))
    return rows


def reference_markdown() -> str:
    """The configuration reference page (``docs/configuration.md``), generated from the schema."""
    lines = [
        "# Configuration reference",
        "",
        "Every key a run config may set, its type and its default. Sections and keys left out",
        "take their defaults; `model.type` and the data (`data.build`, or `data.files` with",
        "`data.reader`) are required. `!pyobject dotted.path` names a class or function for a key",
        "that takes one (see below). Override any key from the command line with",
        "`--set section.key=value` (the value is read as YAML). This page is generated from",
        "`unison/config/schema.py`; a test keeps them equal.",
        "",
        *_PHASES,
        "",
        "## Every key",
        "",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
    ]
    for key, type_name, default, doc in schema_reference():
        cell = type_name.replace("|", "\\|")
        lines.append(f"| `{key}` | {cell} | `{default}` | {doc} |")
    lines += ["", *_BATCHES, "", *_EDITORS, "", *_RESUMING]
    lines += [
        "",
        "## What a config can and cannot do",
        "",
        "Configs travel: copied from papers, colleagues and issue threads. Reading a config and",
        "resolving it imports modules and looks objects up, but calls nothing except the objects",
        "the keys below accept, and nothing a config names can write files, run commands or",
        "import arbitrary modules.",
        "",
        "- **YAML is data.** The loader is PyYAML's safe loader plus `!pyobject`, which only makes",
        "  an inert reference; Python tags (`!!python/object/apply` ...) are refused. A document",
        "  over 1 MiB, nested deeper than 64 levels, or expanding to more than 100000 values",
        "  through its aliases (an alias bomb, a recursive alias) is refused before it is built. A",
        "  key or section given twice is refused, naming both lines.",
        "- **Which modules a `!pyobject` may come from.** torch, ignite and unison (always the",
        "  installed ones); modules beside the config file; and your own modules named under",
        "  `imports:`. Nothing else, and never private names (`_x`), `os`, `subprocess`,",
        "  `builtins`, `torch.hub`, `torch.load` and the like. `__main__` is your own script when",
        "  that script runs the config (`unison.recipe.run(path)`), or the script named by",
        "  `unison run CONFIG --main SCRIPT.py` (also `tune`, `config`; `run(path, main=...)`):",
        '  imported as `__mp_main__` on every rank, so its `if __name__ == "__main__":` block',
        "  does not run (training not behind that guard would start on import). Otherwise, under",
        "  `unison run` it is unison itself, and naming it is an error that says what to write instead.",
        '- **A plain name** (`model.type: "GNNModel"`, `early_stopping.type: DefaultEarlyStopping`,',
        "  as QuantumGrav's configs write them) is looked for in the modules under `imports:` (and",
        "  in your script, as above), and must fit the key as a `!pyobject` must; one found nowhere",
        "  is an error listing what the key could name there.",
        "- **What `imports:` trusts.** Your own code: a module beside the config, or one installed",
        "  or on `sys.path` that is not in Python's standard library, not torch, ignite or unison,",
        "  not a library unison depends on, and not a data loader (`numpy`, `joblib`, `pandas`,",
        "  `yaml` ...). An entry naming one of those is refused. Functions of these modules may",
        "  fill the keys that take your functions; nothing else of theirs can.",
        "- **Modules beside the config** are imported by file path under a private package name,",
        "  the same in every rank; the config's folder is never put on `sys.path`, so a `tqdm.py`",
        "  or `torch.py` there cannot replace the installed package. Modules there import each",
        "  other relatively (`from . import helpers`).",
        "- **Every key that takes a `!pyobject` says what it accepts**, and the object is checked",
        "  before anything is called:",
        "",
        "| key | accepts |",
        "|---|---|",
    ]
    for key, slot in _slot_keys():
        lines.append(f"| `{key}` | {SLOTS[slot].accepts} |")
    lines += [
        "| `validation.metrics.<name>` (or its `type`) | " + SLOTS["metric"].accepts + " |",
        "| any `!pyobject` inside `kwargs` | " + SLOTS["value"].accepts + " |",
        "",
        "Anything else is refused with the file, the line, the key, what was found (for example",
        "`function torch.utils.collect_env.run`) and what the key accepts.",
        "",
        "- **Checked before any rank starts:** every `kwargs` mapping against the signature it",
        "  will be called with (unknown or missing arguments, with the nearest name), the model",
        "  built on the `meta` device with its optimizer and scheduler, the metrics built,",
        "  `training.device` against this machine, and the output folder (it must be writable).",
        "  `data.build` is not called before spawn: its signature is checked; every entry of",
        "  `data.files` must exist. In a process that trains next (a rank under torchrun or",
        "  srun, or a run of one process that spawns none) the model is not built on `meta`:",
        "  a tensor its constructor made there and your code kept (a corpus in an `lru_cache`",
        "  or a module global) would reach training without data; the rank's own build checks",
        "  it. A meta tensor that still reaches training fails at its first iteration with a",
        "  message that says where such a tensor comes from. Each item of `handlers` (your own",
        "  handlers, docs/handlers.md): its class (with `attach(engine)`, or called at its",
        "  `event`) or function, its event (an engine event such as",
        "  `ITERATION_COMPLETED(every=10)`) and its arguments, bound to the signature; the",
        "  handlers are attached in the order written.",
        *_SECRETS,
        "- **The run's `name`** is one folder name: `/`, `\\`, `..` and `~` are refused, so a run",
        "  stays inside `logging.root`.",
        "- **Which checkpoint is best:** when `checkpoint.mode` is left out, a loss-like watched",
        "  metric (`loss`, `*_loss`, `mse`, `mae`, `perplexity` ...; `loss` is watched when",
        "  `validation.metrics` is empty) is minimised, others maximised. A mode that contradicts",
        "  the metric's name (`mode: max` on a loss, `mode: min` on an accuracy) is refused. A",
        "  mode left out stays out of the config (and of the run's saved `config.yaml`): the",
        "  run's plan derives it.",
    ]
    return "\n".join(lines) + "\n"


_PHASES = (
    "## From config to run",
    "",
    "A config becomes a run in three phases. *Plan*: one pass resolves every `!pyobject`",
    "against its key's slot, binds every `kwargs` mapping to the signature it will be called",
    "with, and computes once what the run derives (the watched metric and its mode, the amp",
    "dtype, the compile and DDP/FSDP options, the learning-rate plan, the output root and the",
    "MLflow store, the early-stopping handler) into a `RunPlan`; it starts and writes nothing.",
    "*Preflight*: in the launching process, before any rank is spawned, the plan is checked:",
    "the model built on the `meta` device with its optimizer and scheduler, the metrics built,",
    "the device, the output folder and the tracking store checked (see *Checked before any",
    "rank starts*, below). *Build*: every rank plans again from the config (what a config",
    "names does not travel between processes), builds the same data, model, optimizer,",
    "trainer, evaluator and handlers from the plan, trains, then tests.",
    "From Python, `unison.recipe.plan(config)` is the first phase alone (load the file with",
    "`unison.config.load_config(path, overrides)`), and `unison.recipe.run(path, nproc=...,",
    "overrides=[...], main=...)` takes all three as `unison run` does (`main` is `--main`,",
    "`resume` is `--resume`) and returns rank 0's results. `unison config --check` stops after",
    "the preflight.",
)
"""The three phases a config goes through, and the Python entry points to each."""

_BATCHES = (
    "## Batch sizes: per rank, or global",
    "",
    "`training.batch_size` is per rank and step, as in QuantumGrav's configs and plain DDP: at",
    "N ranks an optimizer update sees `batch_size x N x accumulation_steps` samples, so moving",
    "from 1 rank to 4 changes the update unless the batch size is edited by hand.",
    "`training.global_batch_size` names the update instead: the samples of one optimizer update",
    "across all ranks, `per-rank batch x ranks x accumulation_steps` (DeepSpeed's",
    "`train_batch_size`, Megatron's `global_batch_size`, the total batch size Accelerate and the",
    "Hugging Face Trainer log). Each rank takes `global_batch_size / (ranks x accumulation_steps)`",
    "per step, so `global_batch_size: 64` trains the same updates at 1, 2, 4 or 8 ranks (and, with",
    "`accumulation_steps: 2`, 32, 16, 8 or 4 samples per rank and step). A size that does not divide",
    "is refused before any rank starts (the world size is `--nproc`, `parallel.nproc_per_node`, or",
    "torchrun's and srun's), naming the key, its line, the world size, the nearest sizes that",
    "divide and the world sizes it divides over. `validation.global_batch_size`,",
    "`testing.global_batch_size` and `predict.global_batch_size` are the samples of one evaluation",
    "(or prediction) step across all ranks (per rank: `/ ranks`); evaluation results and predictions",
    "do not depend on them. A section gives `batch_size` or",
    "`global_batch_size`, not both; when the file gives one and `--set` the other, the command line",
    "wins. Without either, training takes 32 per rank, and evaluation the training batch per rank.",
    "With a global batch size the learning rate is the one written at every world size: the string",
    "form of `training.lr_scaling` (by the world size) is refused, and its mapping form scales by",
    "`global_batch_size / reference_batch_size` when a reference is given. A `data.build` function",
    "with a parameter named `world_size` is called with the run's world size on every rank.",
)
"""What a batch size means at N ranks, and the global one."""

_EDITORS = (
    "## Editors and the resolved config",
    "",
    "`unison config CONFIG [--set KEY=VALUE ...]` prints the config a run would use, as YAML:",
    "every key above with its value after defaults, old names (`num_epochs`, `world_size`) and",
    "other trainers' keys under unison's (QuantumGrav's `criterion` kept, with `training.loss` the same,",
    "`training.path` as `logging.root`, `training.checkpoint_at` as `checkpoint.every_epochs`,",
    "`early_stopping.kwargs` as the section's keys), `--set` applied and URL credentials masked.",
    "It checks the config as `unison run` does before it starts any rank, and fails with the",
    "same `file:line: key:` error, but imports nothing the config names: `!pyobject` values are",
    "written back as `!pyobject dotted.path`, and the output loads again into the same config.",
    "`--check` also resolves every `!pyobject` and builds the model on the `meta` device, as",
    "`unison run` does before spawning (this imports the modules the config names).",
    "`--show-origin` ends each key the config gives with `# file:line`, or `# --set key=value`.",
    "",
    "`unison schema [--out FILE]` writes the config's JSON Schema (draft 2020-12), made from this",
    "version's schema: each key with its meaning, default and type; a `Literal` as an `enum`, a",
    "section with no other keys, an old name marked deprecated. It is made by the rules the loader",
    "reads the schema with, so every config `unison config` accepts is valid against it (before,",
    "it refused `data.stream`, empty sections, `log_level: info` and the model keys",
    "`from_config: true` reads): a section may be written empty, `log_level` takes any case, the",
    "`model` section takes keys of the model's own only with `from_config: true`, and `data.build`,",
    "`data.files` or `data.stream` names the data. `tests/config/test_json_schema.py` validates",
    "every config under `recipes/` and the loader's test configs against it. Point a YAML language server at",
    "it with a first line `# yaml-language-server: $schema=unison.schema.json` (or the editor's",
    '`yaml.schemas` setting), and declare the tag with `yaml.customTags: ["!pyobject scalar"]`:',
    "JSON Schema never sees YAML tags, so a `!pyobject` key is checked as a string and what it",
    "names is checked by `unison config --check`. Ranges and keys that depend on each other are",
    "checked by `unison config` too, not by the schema.",
)
"""The two commands that show a config as unison reads it, and the JSON Schema for editors."""

_RESUMING = (
    "## Resuming: the learning rate, other optimizer values and the scheduler's",
    "",
    "A checkpoint holds the optimizer's groups, and loading them puts the saved values back.",
    "The rule of a resumed run (`--resume`): each value the config determines is compared as the",
    "config that saved the checkpoint derived it (that config and world size are stored in the",
    "checkpoint) and as this run's config derives it. Where they agree, the checkpoint's value",
    "stays: it holds the schedule's progress. Where they differ, this run's value is applied",
    "after loading, on every rank, and logged:",
    "",
    "- the learning rate: `training.lr` (else `optimizer_kwargs.lr`, else the optimizer's",
    "  default) after `training.lr_scaling` at the run's world size. A run trained at 2 ranks",
    "  with `lr: 0.1` and `lr_scaling: linear` and resumed at 3 trains at 0.3, and so does a",
    "  `--set training.lr=` of a new value. Every rate moves by the ratio of the two bases, in",
    "  each group and in the scheduler (`base_lrs`, `initial_lr`, `OneCycleLR`'s and",
    "  `CyclicLR`'s peaks), so a schedule continues from the new base at the point it had",
    "  reached: a `StepLR` that had halved the rate once gives half the new base.",
    "  `learning rate on resume: 0.1 -> 0.15 (this config's base 0.3 at 3 ranks; the",
    "  checkpoint's 0.2 at 2 ranks)` says what happened.",
    "- any other key of `training.optimizer_kwargs` (`weight_decay`, `momentum`, `betas`...)",
    "  whose value changed is set in every group (`optimizer momentum on resume: ...`).",
    "- a key of `training.scheduler_kwargs`, which the scheduler's saved state would otherwise",
    "  load over: set on the loaded scheduler where each step reads it afresh (`StepLR`'s",
    "  `step_size` and `gamma`, `MultiStepLR`'s `milestones` and `gamma`, `ExponentialLR`'s",
    "  `gamma`, `CosineAnnealingLR`'s `eta_min`, `ReduceLROnPlateau`'s `factor`, `patience`,",
    "  `threshold`, `cooldown`, `eps`, `min_lr`); `OneCycleLR`'s `max_lr` moves every rate of",
    "  the schedule by new/old (the schedule of the new `max_lr`, at the step reached). Any other",
    "  (`OneCycleLR`'s `total_steps`, `CosineAnnealingLR`'s `T_max`, `CyclicLR`, `LinearLR`, a",
    "  scheduler of another library) would change the schedule's shape where it stands, and is",
    "  refused before any rank starts, naming the key. The log line and `changes-on-resume.jsonl`",
    "  say how each change was applied: `changed on resume: training.scheduler_kwargs.gamma",
    '  0.5 -> 0.1 (applied: set on the loaded StepLR: ...)`, `"applied": "..."` in the record.',
    "",
    "`OneCycleLR` and `CyclicLR` set the learning rate from arguments of their own, so",
    "`training.lr_scaling` scales those (`max_lr`; `base_lr` and `max_lr`) instead of the",
    "optimizer's `lr`, and logs it. A `Checkpoint` used from Python loads what it saved, as",
    "torch's `load_state_dict` does: the rule is `unison run`'s.",
)
"""The rule of a resumed run for the optimizer values the config determines."""

_SECRETS = (
    "- **Secrets are not written back.** A password or a token in a config value is used as",
    "  given and masked as `***` in every copy that leaves the process: the saved `config.yaml`,",
    "  a checkpoint's copy of the config, `metrics.json`, MLflow parameters and tags, W&B's run",
    "  config and metadata, TensorBoard's hparams, records, log lines and error messages (a",
    "  config error echoing such a value included). Exactly what is masked:",
    "  - the password of a URL: `scheme://user:PASSWORD@host` and `scheme://:PASSWORD@host`. The",
    "    password may hold any character, `'`, `\"`, `<`, `>`, spaces, `@`, `/` and `:` included:",
    "    it runs to the **last `@` of its line** (a text cannot tell a password holding `@` from a",
    "    later `@` on the same line, so masking errs toward hiding: on a line holding more `@`s,",
    "    all up to the last is masked);",
    "  - for web URLs (`http`, `https`, `ws`, `wss`, `ftp`, `ftps`, and `git+https`...), a user",
    "    with no password: `https://TOKEN@host`;",
    "  - the value of a query or fragment parameter whose name says it holds a secret",
    "    (`password`, `passwd`, `pwd`, `passphrase`, `secret`, `token`, `api_key`, `access_key`,",
    "    `credential`, `signature` anywhere in the name, and `sig`): `?password=`, `&token=`,",
    "    `;pwd=`, `#access_token=`; the value runs to the next `&`, `;` or `#` (or a space,",
    '    `"`, `<`, `>`);',
    "  - in any text, `NAME=VALUE` where `NAME` ends in `password`, `passwd`, `pwd`,",
    "    `passphrase`, `secret` or `token` (libpq's keyword strings,",
    "    `host=db password='a b' dbname=runs`): spaces around `=` allowed, the value in single",
    "    quotes (with `\\'` and `\\\\` inside) or up to the next space.",
    "",
    "  The user, host, port, path and database stay, for diagnosis. A saved `config.yaml` keeps",
    "  each value on one line so that no password is split. Nothing else is recognised as a",
    "  secret (a password in a plain key such as `data.kwargs.secret_value: x` is not masked).",
    "  Better still, keep passwords out of configs (they",
    "  travel): MLflow reads `MLFLOW_TRACKING_USERNAME` / `MLFLOW_TRACKING_PASSWORD`, and a",
    "  database driver its own variables (`PGPASSWORD`, `~/.pgpass`), so",
    "  `postgresql://user@host/db` is enough. A config holding a masked `:***@` (a saved",
    "  `config.yaml`) is refused with that advice.",
)
"""How credentials in store URLs are kept out of every copy of a config."""


def _slot_keys() -> list[tuple[str, str]]:
    """(key path, slot) of every schema key that takes a ``!pyobject``."""
    return [(".".join(key.path), key.slot) for key in walk_keys() if key.slot]
