"""ignite's tests that do not apply to unison's Engine here, each with its reason.

Only what cannot apply belongs here: a package, device or network this machine lacks, or a
behaviour unison changes on purpose. A test that fails because unison's Engine differs from
ignite's by mistake stays out: its failure is the point of the suite.

A key is a test's node id (``path::name``, as pytest prints it) or a test module's path.

- A node id is run anyway; if it passes, the harness says so (remove it then).
- A module path is not collected at all (``--ignore``): for modules that cannot be imported.
- Node ids also in ``NOT_RUN`` are deselected: they cannot run here or would take minutes
  without building an Engine of unison's.
"""

from __future__ import annotations

NOT_APPLICABLE: dict[str, str] = {
    # -- deliberate differences of unison's Engine -------------------------------------------
    "tests/ignite/engine/test_custom_events.py::test_distrib_gloo_cpu_or_gpu": (
        "runs a DataLoader(shuffle=True) without a DistributedSampler on each of 2 ranks; unison's "
        "Engine refuses a RandomSampler with several ranks on purpose (each rank would draw the whole "
        "dataset)"
    ),
    # -- what this machine (and CI) lacks -----------------------------------------------------
    "tests/ignite/handlers/test_lr_finder.py::test_distrib_gloo_cpu_or_gpu": (
        "downloads MNIST with torchvision at run time (no network, no torchvision); its loader also "
        "shuffles without a DistributedSampler, which unison refuses with 2 ranks"
    ),
    "tests/ignite/handlers/test_clearml_logger.py": (
        "imports clearml, the client of the ClearML service (16 packages), at the top; its one "
        "distributed test saves a Checkpoint through a mocked ClearML, which test_checkpoint.py covers"
    ),
    # metric modules (the opt-in metrics run) whose reference implementations are not installed
    "tests/ignite/metrics/gan/test_fid.py": (
        "imports pytorch_fid, which ignite's CI installs from a git fork (not from the registry) and "
        "which needs torchvision"
    ),
    "tests/ignite/metrics/gan/test_utils.py": (
        "imports torchvision: PyPI's build does not match the CPU-only torch here (it would replace it)"
    ),
    "tests/ignite/metrics/rec_sys/test_ndcg.py": (
        "imports ranx, whose numba/llvmlite dependencies are too heavy for a reference implementation"
    ),
    "tests/ignite/metrics/vision/test_object_detection_map.py": (
        "its distributed tests build ObjectDetectionAvgPrecisionRecall, which needs torchvision (see above)"
    ),
    "tests/ignite/metrics/nlp/test_rouge.py::test_distrib_gloo_cpu_or_gpu": (
        "needs nltk's 'punkt_tab' tokenizer data, which nltk downloads at run time (no network)"
    ),
    "tests/ignite/metrics/gan/test_inception_score.py::test_distrib_cpu": (
        "pytest >= 9's approx() iterates the expected value, here a 0-d tensor: TypeError with ignite's "
        "own Engine too"
    ),
    # -- ignite's DeterministicEngine, which the plugin does not replace -----------------------
    "tests/ignite/engine/test_deterministic.py::test_gradients_on_resume_cpu": (
        "ignite's DeterministicEngine only (no Engine of unison's is built); 90 s of DataLoader workers"
    ),
    "tests/ignite/engine/test_deterministic.py::test_resume_random_dataloader_from_iter": (
        "ignite's DeterministicEngine only (no Engine of unison's is built); 30 s of DataLoader workers"
    ),
    "tests/ignite/engine/test_deterministic.py::test_resume_random_dataloader_from_epoch": (
        "ignite's DeterministicEngine only (no Engine of unison's is built); 25 s of DataLoader workers"
    ),
}

NOT_RUN: frozenset[str] = frozenset(
    {
        "tests/ignite/engine/test_deterministic.py::test_gradients_on_resume_cpu",
        "tests/ignite/engine/test_deterministic.py::test_resume_random_dataloader_from_iter",
        "tests/ignite/engine/test_deterministic.py::test_resume_random_dataloader_from_epoch",
    }
)
"""Entries of ``NOT_APPLICABLE`` that are deselected rather than run."""
