"""A tensor of the meta device that reaches training, named with its likely cause.

A meta tensor has a shape and no data: the first operation that needs its values fails deep in
torch (``NotImplementedError: Cannot copy out of meta tensor; no data!``), at the first
iteration, with nothing that says where the tensor came from. The usual source is the user's
own cache: a tensor made while a model was built under ``with torch.device("meta")`` (as the
checks before the ranks start build it, in the launching process) and kept by an
``lru_cache`` or a module global that ``data.build`` or the model's constructor reads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from unison.engine import Engine


def is_meta_error(err: BaseException) -> bool:
    """Whether ``err`` is torch refusing to read a meta tensor's data.

    Example:
        >>> is_meta_error(NotImplementedError("Cannot copy out of meta tensor; no data!"))
        True
        >>> is_meta_error(NotImplementedError("subclasses implement forward"))
        False
    """
    text = str(err).lower()
    return isinstance(err, (NotImplementedError, RuntimeError)) and (
        "meta tensor" in text or "meta device" in text
    )


@contextlib.contextmanager
def meta_tensors_named(trainer: Engine) -> Iterator[None]:
    """Runs the block (the training loop); a meta tensor met there is raised again as a
    ``RuntimeError`` that says where such a tensor comes from and what to do.

    Example:
        >>> import torch
        >>> from ignite.engine import Engine
        >>> try:
        ...     with meta_tensors_named(Engine(lambda e, b: None)):
        ...         torch.empty(2, device="meta").cpu()
        ... except RuntimeError as err:
        ...     print(str(err).split(":")[0])
        training met a tensor on the meta device, which holds no data
    """
    try:
        yield
    except (NotImplementedError, RuntimeError) as err:
        if not is_meta_error(err):
            raise
        state = trainer.state
        raise RuntimeError(
            f"training met a tensor on the meta device, which holds no data: {err} (epoch {state.epoch}, "
            f"iteration {state.iteration}). A tensor of the batch or the model was made on the meta device "
            "and kept: one built under `with torch.device('meta')` (as a model is built during the checks "
            "made before the ranks start, in the launching process) and cached by your code, a "
            "functools.lru_cache or a module global that data.build or the model's constructor reads (a "
            "tokenised corpus kept for its vocabulary size). Make tensors where they are used, or cache "
            "plain data (lists, numpy arrays) and make the tensors from it in data.build and the model"
        ) from err
