"""The private torch and ignite APIs unison relies on: each behaves as relied on in the installed
versions, each probe notices a change, and the code that uses one refuses or warns when it
changed instead of going on silently."""

from __future__ import annotations

import pickle

import pytest
from ignite.engine import Engine as IgniteEngine
from ignite.engine import Events
from torch import nn

from unison.cli import private_apis
from unison.cli.private_apis import PRIVATE_APIS, probe_all
from unison.distributed import compile_hook
from unison.distributed.compile import compile_model, is_compiled
from unison.engine import Engine, ignite_internals


@pytest.fixture
def fresh_probes():
    """The run-time checks run once per process: forget their answers before and after."""
    compile_hook.compiled_call_problem.cache_clear()
    ignite_internals.ignite_internals_problem.cache_clear()
    yield
    compile_hook.compiled_call_problem.cache_clear()
    ignite_internals.ignite_internals_problem.cache_clear()


@pytest.mark.parametrize("api", PRIVATE_APIS, ids=lambda api: api.name.split(":")[0][:50])
def test_every_private_api_behaves_as_relied_on_in_the_installed_versions(api):
    assert api.probe() is None, f"{api.name}: {api.probe()}; {api.if_changed}"


def test_the_registry_names_each_api_once_with_what_a_change_does():
    names = [api.name for api in PRIVATE_APIS]
    assert len(set(names)) == len(names)
    for api in PRIVATE_APIS:
        assert api.used_when and api.if_changed and api.at_run_time and api.severity in ("blocks", "warning")


# --- a torch that no longer runs Module._compiled_call_impl ------------------------------------


@pytest.fixture
def call_ignores_compiled(monkeypatch, fresh_probes):
    """``nn.Module.__call__`` that runs the module's own call, whatever ``_compiled_call_impl`` holds."""
    monkeypatch.setattr(nn.Module, "__call__", nn.Module._call_impl)


def test_the_compiled_call_probe_notices_a_call_that_ignores_it(call_ignores_compiled):
    assert "no longer runs" in compile_hook.compiled_call_problem()


def test_compile_refuses_where_the_model_would_train_uncompiled_while_reported_compiled(
    call_ignores_compiled,
):
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(compile_hook.CompiledCallChanged, match=r"training\.compile: false"):
        compile_model(model)
    assert not is_compiled(model)


# --- an ignite that no longer reads a wrapper's _parent -----------------------------------------


@pytest.fixture
def ignite_ignores_parent(monkeypatch, fresh_probes):
    monkeypatch.setattr(
        IgniteEngine, "_compare_handlers", staticmethod(lambda user, registered: user == registered)
    )


def test_the_ignite_probe_notices_handlers_no_longer_found_by_parent(ignite_ignores_parent):
    assert "_parent" in ignite_internals.ignite_internals_problem()


def test_a_filtered_handler_refuses_to_attach_on_such_an_ignite(ignite_ignores_parent):
    engine = Engine(lambda engine, batch: None)
    with pytest.raises(ignite_internals.IgniteInternalsChanged, match=r"pytorch-ignite>=0\.5\.5,<0\.6"):
        engine.add_event_handler(Events.EPOCH_COMPLETED(every=2), lambda engine: None)


def test_on_this_ignite_a_filtered_handler_is_found_and_removed_by_itself(fresh_probes):
    engine = Engine(lambda engine, batch: None)
    calls = []

    def handler(engine):
        calls.append(engine.state.epoch)

    engine.add_event_handler(Events.EPOCH_COMPLETED(every=2), handler)
    assert engine.has_event_handler(handler, Events.EPOCH_COMPLETED)
    engine.run([0], max_epochs=4)
    assert calls == [2, 4]
    engine.remove_event_handler(handler, Events.EPOCH_COMPLETED)
    assert not engine.has_event_handler(handler)


# --- the other probes notice a change too -------------------------------------------------------


def test_the_ddp_probe_notices_a_ddp_that_builds_its_reducer_another_way(monkeypatch):
    from torch.nn.parallel import DistributedDataParallel

    def init(self, module):  # builds no Reducer from _build_params_for_reducer
        nn.Module.__init__(self)

    monkeypatch.setattr(DistributedDataParallel, "__init__", init)
    assert "_build_params_for_reducer" in private_apis._ddp_bucket_hooks()


def test_the_metadata_probe_notices_a_class_the_allow_list_refuses(monkeypatch):
    from unison.checkpoint import sharded_check

    def refuse(folder):
        raise pickle.UnpicklingError("it refers to pathlib._local.PosixPath")

    monkeypatch.setattr(sharded_check, "read_metadata", refuse)
    assert "pathlib._local.PosixPath" in private_apis._metadata_allow_list()


def test_the_layout_probe_notices_a_missing_function(monkeypatch):
    import torch.serialization

    monkeypatch.delattr(torch.serialization, "_get_layout")
    assert "ImportError" in private_apis._layout_by_name()


def test_the_optimizer_init_probe_notices_a_torch_that_no_longer_calls_it(monkeypatch):
    from torch.distributed.checkpoint import state_dict

    monkeypatch.delattr(state_dict, "_init_optim_state")
    assert "no _init_optim_state" in private_apis._optim_init()
    monkeypatch.setattr(state_dict, "_init_optim_state", lambda optimizer: None, raising=False)
    monkeypatch.setattr(
        state_dict, "_get_optim_state_dict", _stepping_each_time(state_dict._get_optim_state_dict)
    )
    assert "2 times" in private_apis._optim_init()


def _stepping_each_time(get):  # a torch that initialises by a path of its own, around the function
    def stepped(model, optimizers, info):
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = p.detach() * 0
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return get(model, optimizers, info)

    return stepped


def test_the_record_crc_probe_notices_a_torch_that_reads_its_setting_elsewhere(monkeypatch):
    import torch

    own = torch.serialization.get_crc32_options

    class Writers:  # a torch whose zip writers hold the function they were built with
        read = staticmethod(own)

    monkeypatch.setattr(torch.serialization, "_open_zipfile_writer_buffer", _writer_reading(Writers))
    assert "no longer reads" in private_apis._record_crcs()


def test_the_one_pass_probe_notices_a_torch_that_reads_an_archive_otherwise(monkeypatch):
    import unison.checkpoint.archive_pass as archive_pass

    assert private_apis._one_pass() is None
    real = archive_pass.Layout.serve

    def serve(self, view, pos):  # a torch that reads each local header with its name and extra field
        return (
            real(self, memoryview(bytearray(len(view) + 60)), pos)
            if pos in self._headers
            else real(self, view, pos)
        )

    monkeypatch.setattr(archive_pass.Layout, "serve", serve)
    assert "bytes other than" in private_apis._one_pass()


def _writer_reading(writers):
    import torch

    class Buffer(torch.serialization._opener):
        def __init__(self, buffer):
            super().__init__(torch._C.PyTorchFileWriter(buffer, writers.read(), 64))

        def __exit__(self, *args):
            self.file_like.write_end_of_file()

    return Buffer


def test_probe_all_reports_each_api_with_its_answer():
    answers = probe_all()
    assert [api for api, _ in answers] == list(PRIVATE_APIS)
