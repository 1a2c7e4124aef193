"""The check of ``unison doctor`` on elastic recovery: what makes a torchrun job recover, and fast.

Under torchrun, a worker sees the agent's choices in its environment: the rendezvous id
(``TORCHELASTIC_RUN_ID``), ``--max-restarts`` (``TORCHELASTIC_MAX_RESTARTS``) and whether it
shares the agent's rendezvous store (``TORCHELASTIC_USE_AGENT_STORE``). torch's c10d
rendezvous shares that store unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is set in the
agent's environment; with it shared, a node joining a running job, or a restarted group,
can fail to meet. Outside torchrun the section gives the same settings as advice only.
"""

from __future__ import annotations

from collections.abc import Mapping

from unison.cli.doctor_checks import Section
from unison.distributed.env import detect_launcher
from unison.distributed.job import NO_JOB_ID

SHARE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
RDZV_CONF = (
    "join_timeout=300,last_call_timeout=5,close_timeout=10,keep_alive_interval=2,keep_alive_max_attempt=3"
)
"""Rendezvous timeouts that re-form a group in seconds rather than torch's 30 s + 30 s."""
ADVICE = (
    f"export {SHARE_VAR}=1; torchrun --max-restarts=3 --monitor-interval=1 "
    f"--rdzv-backend=c10d --rdzv-id=<unique job id> --rdzv-conf {RDZV_CONF} ..."
)
_SHOWN = (
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    SHARE_VAR,
    "PET_RDZV_CONF",
    "PET_MAX_RESTARTS",
    "PET_MONITOR_INTERVAL",
)


def check_elastic(env: Mapping[str, str]) -> Section:
    """The elastic settings of this torchrun worker, each missing one a warning with its fix;
    outside torchrun, the settings to launch with (no problem raised)."""
    section = Section("Elastic recovery (torchrun)")
    for name in _SHOWN:
        if name in env:
            section.add(name, env[name])
    try:
        under_torchrun = detect_launcher(dict(env)).kind == "torchrun"
    except ValueError:  # placement variables that are not integers: the launcher check blocks on them
        under_torchrun = False
    if not under_torchrun:
        section.add("advice", ADVICE)
        return section
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and env.get(SHARE_VAR) != "1":
        section.problem(
            "warning",
            "the workers share the torchrun agent's rendezvous store (torch's default for the c10d backend): "
            "a node joining a running job waits for a key the old rank-0 agent never publishes and the agents "
            "fail, and a restarted group can fail to connect",
            f"export {SHARE_VAR}=1 in every agent's environment, before torchrun",
        )
    if env.get("TORCHELASTIC_MAX_RESTARTS") == "0":
        section.problem(
            "warning",
            "torchrun was started with --max-restarts=0 (its default): one worker crash ends the job",
            "torchrun --max-restarts=3 (each restart resumes the newest checkpoint; a node joining or "
            f"leaving uses one too), with --monitor-interval=1 and --rdzv-conf {RDZV_CONF}",
        )
    if env.get("TORCHELASTIC_RUN_ID", "").strip() in ("", NO_JOB_ID):
        section.problem(
            "warning",
            f"the rendezvous id is {env.get('TORCHELASTIC_RUN_ID', '')!r}, which names no job: a restarted "
            "worker group of `unison run` starts a fresh run instead of resuming its own",
            "torchrun --rdzv-id=<an id unique to the job> (under SLURM: --rdzv-id=$SLURM_JOB_ID), "
            "or pass --resume auto",
        )
    return section
