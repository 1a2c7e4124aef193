"""The documentation lines of ``parallel`` keys defined in :mod:`unison.config.schema`."""

from __future__ import annotations

AC_DOC = (
    "recompute the activations of the chosen blocks in the backward pass (less memory, about one more "
    "forward of each block): false; auto (strategy fsdp: the FSDP units, else the repeated blocks: classes "
    "with 2+ instances holding parameters, those made of layers); or a list of class names. Checkpoints keep "
    "the plain keys (docs/sharded.md)"
)
