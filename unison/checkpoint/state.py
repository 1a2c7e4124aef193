"""What goes into a checkpoint, in forms that ``torch.load(weights_only=True)`` accepts."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from unison.distributed.model import unwrap_model


def capture_rng() -> dict[str, Any]:
    """This process's random number generator states: Python, NumPy, torch CPU and CUDA."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is optional
        pass
    else:
        numpy_state: Any = np.random.get_state()
        name, keys, pos, has_gauss, cached = numpy_state
        state["numpy"] = {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Puts back the generator states taken by :func:`capture_rng`."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        st = state["numpy"]
        np.random.set_state(
            (st["name"], st["keys"].numpy().astype(np.uint32), st["pos"], st["has_gauss"], st["cached"])
        )
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = list(state["cuda"])
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights of a model without any DDP wrapper: keys have no ``module.`` prefix."""
    return unwrap_model(model).state_dict()


def load_model_state(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Loads weights saved with or without DDP's ``module.`` prefix into a plain or DDP model."""
    if state and all(key.startswith("module.") for key in state):
        state = {key[len("module.") :]: value for key, value in state.items()}
    unwrap_model(model).load_state_dict(state)


def to_cpu_copy(obj: Any, reuse: Any = None) -> Any:
    """A deep copy of nested containers with every tensor copied to CPU memory.

    What an asynchronous save writes, while training goes on changing the originals.
    With ``reuse``, an earlier copy of the same structure that nothing reads any more,
    tensors of matching shape and dtype are copied into its buffers instead of freshly
    allocated ones: allocating is most of the cost of a copy.
    """
    if isinstance(obj, torch.Tensor):
        if (
            isinstance(reuse, torch.Tensor)
            and reuse.shape == obj.shape
            and reuse.dtype == obj.dtype
            and reuse.device.type == "cpu"
            and reuse.is_contiguous()
        ):
            return reuse.copy_(obj.detach())
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        previous = reuse if isinstance(reuse, Mapping) else {}
        return {k: to_cpu_copy(v, previous.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        earlier = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(obj) else [None] * len(obj)
        copied = [to_cpu_copy(v, p) for v, p in zip(obj, earlier, strict=True)]
        return copied if isinstance(obj, list) else tuple(copied)
    return obj
