"""The private torch and ignite APIs unison relies on, each with a probe of the installed versions.

Where torch or ignite has no public hook for what unison needs, unison uses a private one.
A private API can disappear or change meaning in any release, so each is listed here with
a probe: a small check, run in this process without a process group, that the installed
version still behaves as relied on. ``unison doctor`` runs every probe and reports each
API as in use or changed; ``tests/test_private_apis.py`` runs them against the versions
the suite is tested with. Where a changed API would otherwise fail silently, the code
that uses it checks at run time too, and refuses or warns (``at_run_time`` says which).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from unison.cli import checkpoint_apis
from unison.cli.doctor_checks import Section
from unison.distributed.compile_hook import compiled_call_problem
from unison.engine.ignite_internals import ignite_internals_problem


@dataclass(frozen=True)
class PrivateApi:
    """A private torch or ignite API unison relies on.

    Attributes:
        name: what is relied on.
        used_when: when a run uses it.
        if_changed: what would go wrong if it changed.
        at_run_time: what unison does at run time when it has changed.
        severity: ``blocks`` when runs that use it fail or lose a guarantee, else ``warning``.
        probe: returns None when the installed version behaves as relied on, else what changed.
    """

    name: str
    used_when: str
    if_changed: str
    at_run_time: str
    severity: Literal["blocks", "warning"]
    probe: Callable[[], str | None]


def _quietly(probe: Callable[[], str | None]) -> Callable[[], str | None]:
    """``probe`` with warnings silenced, and any exception reported as the change it shows."""

    @functools.wraps(probe)
    def run() -> str | None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return probe()
        except Exception as err:  # a missing module, attribute or argument: exactly what changed
            return f"{type(err).__name__}: {err}"

    return run


def _missing(owner: Any, names: tuple[str, ...], where: str) -> str | None:
    gone = [name for name in names if not callable(getattr(owner, name, None))]
    return f"{where} has no {', '.join(gone)}" if gone else None


@_quietly
def _ddp_bucket_hooks() -> str | None:
    from torch._C._distributed_c10d import Reducer
    from torch.nn.parallel import DistributedDataParallel as DDP

    problem = _missing(DDP, ("_build_params_for_reducer",), "DistributedDataParallel") or _missing(
        Reducer, ("_push_all_rebuilt_params", "_rebuild_buckets"), "torch's DDP Reducer"
    )
    if problem is None and "_build_params_for_reducer" not in DDP.__init__.__code__.co_names:
        problem = (
            "DistributedDataParallel no longer builds its Reducer's parameters by _build_params_for_reducer()"
        )
    if problem is None and "_has_rebuilt_buckets" not in DDP._pre_forward.__code__.co_names:
        problem = "DDP's forward no longer reads _has_rebuilt_buckets"
    return problem


_metadata_allow_list = _quietly(checkpoint_apis.metadata_allow_list)
_dcp_bytes_hook = _quietly(checkpoint_apis.dcp_bytes_hook)
_layout_by_name = _quietly(checkpoint_apis.layout_by_name)
_optim_init = _quietly(checkpoint_apis.optim_init)
_record_crcs = _quietly(checkpoint_apis.record_crcs)
_one_pass = _quietly(checkpoint_apis.one_pass)
_rank_files = _quietly(checkpoint_apis.rank_files)
_kept_staging = _quietly(checkpoint_apis.kept_staging)


@_quietly
def _dtensor_caches() -> str | None:
    import torch.distributed.tensor._redistribute as redistribute

    return _missing(torch._C, ("_clear_DTensor_sharding_propagator_cache",), "torch._C") or _missing(
        redistribute, ("clear_redistribute_planner_cache",), "torch.distributed.tensor._redistribute"
    )


@_quietly
def _foreach_copy() -> str | None:
    into, source = [torch.zeros(2), torch.zeros(3)], [torch.ones(2), torch.full((3,), 2.0)]
    torch._foreach_copy_(into, source)
    return None if all(torch.equal(a, b) for a, b in zip(into, source, strict=True)) else "it copies nothing"


@_quietly
def _compile_helpers() -> str | None:
    from torch import nn
    from torch._dynamo import trace_rules
    from torch._inductor import list_mode_options

    if not list_mode_options("max-autotune", None).get("max_autotune"):
        return "torch._inductor.list_mode_options('max-autotune') no longer sets max_autotune"
    if not trace_rules.check(nn.Linear(1, 1).forward):
        return "torch._dynamo.trace_rules.check no longer marks torch's own modules as skipped"
    return None


@_quietly
def _ignite_filters() -> str | None:
    from ignite.engine import Events

    from unison.engine.filters import _predicate

    filters = [Events.ITERATION_COMPLETED(every=3).filter, Events.EPOCH_COMPLETED(once=2).filter]
    found = [_predicate(f) if f is not None else None for f in filters]
    expected = [("every", (3,)), ("once", (frozenset({2}),))]
    return None if found == expected else f"ignite's filter factories changed (read {found})"


PRIVATE_APIS: tuple[PrivateApi, ...] = (
    PrivateApi(
        "torch.distributed.checkpoint: the planner's load_bytes sees every non-tensor value "
        "(_EmptyStateDictLoadPlanner, state_dict_loader._load_state_dict)",
        "reading a sharded checkpoint's non-tensor values safely (export, consolidate)",
        "values would be unpickled by torch.load(weights_only=False): a folder from elsewhere could run code",
        "the reading fails (a missing class or function); a hook never called is caught only here",
        "blocks",
        _dcp_bytes_hook,
    ),
    PrivateApi(
        "torch.distributed.checkpoint .metadata classes, where unison's allow-list expects them",
        "every check of a sharded checkpoint folder (resume, export)",
        "every sharded checkpoint is judged damaged",
        "the folder is refused as damaged, naming the class",
        "blocks",
        _metadata_allow_list,
    ),
    PrivateApi(
        "torch.serialization._get_layout",
        "reading a sharded checkpoint's .metadata",
        "tensor layouts in .metadata do not read: every sharded checkpoint is judged damaged",
        "the folder is refused as damaged",
        "blocks",
        _layout_by_name,
    ),
    PrivateApi(
        "torch.nn.Module._compiled_call_impl",
        "compile (training.compile)",
        "the model trains uncompiled while reported compiled",
        "compile refuses to start (CompiledCallChanged)",
        "blocks",
        compiled_call_problem,
    ),
    PrivateApi(
        "ignite Engine._handler_wrapper, wrapper._parent, Engine._event_handlers",
        "every run (filtered handlers, has_event_handler, the handlers saved with checkpoints)",
        "filtered handlers attached twice and left out of checkpoints",
        "the first filtered handler refuses to attach (IgniteInternalsChanged)",
        "blocks",
        ignite_internals_problem,
    ),
    PrivateApi(
        "DDP bucket hooks: DistributedDataParallel._build_params_for_reducer, "
        "Reducer._push_all_rebuilt_params / _rebuild_buckets, _has_rebuilt_buckets",
        "DDP (FixedBucketsDDP)",
        "a resume at 3 or more ranks differs from the uninterrupted run in the last bits",
        "a RuntimeWarning when the model is wrapped",
        "warning",
        _ddp_bucket_hooks,
    ),
    PrivateApi(
        "torch._C._clear_DTensor_sharding_propagator_cache, "
        "torch.distributed.tensor._redistribute.clear_redistribute_planner_cache",
        "a rank leaving after a sharded (FSDP2) run",
        "the process group's threads outlive its destroy",
        "none: the cache is left as it is",
        "warning",
        _dtensor_caches,
    ),
    PrivateApi(
        "torch._foreach_copy_",
        "EMA (handlers.ema)",
        "the EMA cannot copy its average",
        "EMA fails with the error torch raises",
        "warning",
        _foreach_copy,
    ),
    PrivateApi(
        "torch._inductor.list_mode_options, torch._dynamo.trace_rules.check",
        "compile on the CPU; compile of a module of torch's own class",
        "compile options or the compiled frame differ from what unison sets up",
        "compile fails with the error torch raises (trace_rules: decided by the class's module instead)",
        "warning",
        _compile_helpers,
    ),
    PrivateApi(
        "torch.distributed.checkpoint.state_dict._init_optim_state",
        "sharded saves and resumes of an optimizer that keeps no state (SGD without momentum)",
        "every such save gives each parameter a zero gradient and takes a step again, as torch does",
        "torch's initialisation runs at every call (correct, slower, a model-sized allocation)",
        "warning",
        _optim_init,
    ),
    PrivateApi(
        "torch.serialization's zip writers read get_crc32_options() at each save",
        "sharded saves (DCP's torch.save of each tensor, its records' CRC-32s left out)",
        "each record's CRC-32 is computed again, on one core (15 ms per 64 MiB)",
        "the CRC-32s are computed (correct, slower)",
        "warning",
        _record_crcs,
    ),
    PrivateApi(
        "torch.load of a file object: the end of the central directory found in its last 4 KiB, a record's data found from its local header's two lengths, and read whole",
        "every resume and load of a checkpoint file, and of a sharded checkpoint's tensor items",
        "the file is read with torch.load reading every local header first (a cold 101 MB resume took 61 ms against 46 here)",
        "the file is read as before (correct, slower)",
        "warning",
        _one_pass,
    ),
    PrivateApi(
        "torch.distributed.checkpoint: a storage writer's write_data results reach its finish() on the coordinator as returned",
        "sharded saves (each rank's file checksums, finite check and, for an asynchronous save, word that its "
        "copy held still, sent among its write results)",
        "rank 0 would not know every rank's checksums as they were written, nor whether its shards were finite",
        "rank 0 reads every rank's files back for their checksums and loads their tensors back to check them, and "
        "asynchronous saves copy every shard before they return (correct, slower: the folder read once more)",
        "warning",
        _rank_files,
    ),
    PrivateApi(
        "torch.distributed._state_dict_utils: _create_cpu_state_dict makes the CPU buffers a state is copied into",
        "asynchronous sharded saves (their CPU copy kept from save to save, the optimizers' shards copied beside "
        "the next iteration)",
        "an asynchronous sharded save could not stage its copy, or would stage a wrong one",
        "each asynchronous sharded save copies every shard anew through DCP's own staging before it returns "
        "(correct, slower: at 1 GB a stall of about 0.8 s a save instead of 0.01 s)",
        "warning",
        _kept_staging,
    ),
    PrivateApi(
        "ignite's event filter closures (every, once, before, after)",
        "handlers on filtered events",
        "filtered handlers run through ignite's slower wrapper (correct, ~20 more calls per iteration)",
        "the slower wrapper is used",
        "warning",
        _ignite_filters,
    ),
)
"""Every private torch or ignite API unison relies on, most consequential first."""


def probe_all() -> list[tuple[PrivateApi, str | None]]:
    """Each private API with what changed in the installed version (None: behaves as relied on)."""
    return [(api, api.probe()) for api in PRIVATE_APIS]


def check_private_apis(env: Mapping[str, str]) -> Section:
    """``unison doctor``'s section: each private API, in use or changed, and a problem per change."""
    section = Section("Private APIs (torch, ignite)")
    for api, changed in probe_all():
        section.add(api.name, f"in use: {api.used_when}" if changed is None else f"CHANGED: {changed}")
        if changed is not None:
            section.problem(
                api.severity,
                f"{api.name} changed in this torch/ignite ({changed}): {api.if_changed}; at run time: "
                f"{api.at_run_time}",
                "install the versions unison is tested with (pip install torch==2.13.0 "
                '"pytorch-ignite>=0.5.5,<0.6"), or avoid what uses it: ' + api.used_when,
            )
    return section
