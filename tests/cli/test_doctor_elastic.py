"""unison doctor on elastic recovery: the torchrun settings a job recovers with, and fast."""

from __future__ import annotations

import io

from unison.cli.doctor import run_doctor
from unison.cli.elastic_checks import SHARE_VAR, check_elastic
from unison.distributed.env import find_free_port

WORKER = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
RECOVERS = {
    **WORKER,
    "TORCHELASTIC_RUN_ID": "job-7",
    "TORCHELASTIC_MAX_RESTARTS": "3",
    "TORCHELASTIC_USE_AGENT_STORE": "False",
    SHARE_VAR: "1",
}


def _problems(env: dict[str, str]) -> list[str]:
    return [p.what for p in check_elastic(env).problems]


def test_a_worker_set_up_to_recover_has_no_problem():
    assert _problems(RECOVERS) == []
    lines = dict(check_elastic(RECOVERS).lines)
    assert lines["TORCHELASTIC_RUN_ID"] == "job-7" and lines["TORCHELASTIC_MAX_RESTARTS"] == "3"


def test_a_shared_rendezvous_store_warns_with_the_variable_to_set():
    section = check_elastic({**RECOVERS, "TORCHELASTIC_USE_AGENT_STORE": "True", SHARE_VAR: "0"})
    [problem] = section.problems
    assert problem.severity == "warning" and "share the torchrun agent's rendezvous store" in problem.what
    assert f"export {SHARE_VAR}=1" in problem.fix


def test_the_static_backend_shares_the_store_whatever_the_variable_says():
    # static rendezvous always shares it: with the variable set there is nothing more to do
    assert _problems({**RECOVERS, "TORCHELASTIC_USE_AGENT_STORE": "True"}) == []


def test_no_restarts_and_no_job_id_each_warn_with_the_flag():
    section = check_elastic({**RECOVERS, "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none"})
    fixes = " | ".join(p.fix for p in section.problems)
    assert len(section.problems) == 2 and all(p.severity == "warning" for p in section.problems)
    assert "--max-restarts=3" in fixes and "--rdzv-conf join_timeout=" in fixes
    assert "--rdzv-id=$SLURM_JOB_ID" in fixes and "--resume auto" in fixes


def test_outside_torchrun_it_advises_and_raises_nothing():
    section = check_elastic({})
    assert section.problems == []
    advice = dict(section.lines)["advice"]
    assert f"{SHARE_VAR}=1" in advice and "--max-restarts=" in advice and "--rdzv-conf" in advice


def test_the_report_shows_the_section_and_warnings_do_not_block():
    out = io.StringIO()
    env = {**WORKER, "MASTER_PORT": str(find_free_port()), "TORCHELASTIC_RUN_ID": "none"}
    env |= {"TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    code = run_doctor(stream=out, environ=env)
    text = out.getvalue()
    assert code == 0, text
    assert "Elastic recovery (torchrun)" in text and text.count("[warning]") >= 3, text
