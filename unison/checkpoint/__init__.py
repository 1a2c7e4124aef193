"""Checkpoint files: durable writes, the manifest of a folder, and what a checkpoint holds."""

from unison.checkpoint.io import CheckpointError, atomic_save, atomic_write_json, is_complete, load_checkpoint
from unison.checkpoint.manifest import Entry, Manifest, checkpoint_name
from unison.checkpoint.retention import Retention, best_entry, retain
from unison.checkpoint.state import capture_rng, load_model_state, model_state, restore_rng

__all__ = [
    "CheckpointError",
    "Entry",
    "Manifest",
    "Retention",
    "atomic_save",
    "atomic_write_json",
    "best_entry",
    "capture_rng",
    "checkpoint_name",
    "is_complete",
    "load_checkpoint",
    "load_model_state",
    "model_state",
    "restore_rng",
    "retain",
]
