"""DDP whose gradient buckets are laid out once, at construction, so a resumed run is exact.

The problem. ``DistributedDataParallel`` (torch 2.13, ``find_unused_parameters=False``)
starts with one bucket holding every parameter in definition order (its initial bucket cap
is ``sys.maxsize``); after the first backward its Reducer *rebuilds* the buckets in the
order the gradients became ready (caps of 1 MiB for the first bucket, 25 MiB after). Each
bucket is all-reduced as one flat tensor, and gloo's ring all-reduce adds the ranks'
values of an element in an order that depends on where the element sits in that tensor.
With three or more ranks ``(a + b) + c`` and ``(b + c) + a`` differ in the last bit, so the
first iteration of every fresh DDP wrap sums differently from all later ones. A run
resumed at iteration ``k`` does its iteration ``k + 1`` with the initial layout where the
uninterrupted run used the rebuilt one: measured on an MLP 8-16-16-3 at 3 gloo ranks,
the initial layout is ``[[0, 1, 2, 3, 4, 5]]`` (parameter indices; one bucket of 1868
bytes), the rebuilt one ``[[5, 4, 3, 2, 1, 0]]``, and the parameters after 6 iterations
differ by 2.98e-8 for every resume point. At 1 and 2 ranks ``a + b == b + a`` hides it.

The fix. :class:`FixedBucketsDDP` hands the Reducer its parameters in *reverse*
definition order (the order in which a backward pass normally produces their
gradients, and the order DDP itself assumes for its initial buckets when
``find_unused_parameters=True``), then performs DDP's one-time rebuild at construction,
from that order and with DDP's own rebuild caps. The Reducer then never rebuilds again:
the layout of a fresh wrap is the layout of every later iteration, a resumed run sums
exactly as the uninterrupted one, and the buckets still fill from the last layer to
the first, so all-reduces overlap the backward pass as in stock DDP. For models whose
backward runs in reverse definition order (sequential stacks: the MLP above, 784-512-512-10
whose rebuilt buckets are ``[[5, 4, 3, 2], [1, 0]]``) the layout is exactly the one stock
DDP rebuilds to, so the steady-state cost is unchanged (from the second iteration on,
both issue the same all-reduces on the same buffers; measured at 3 gloo ranks on 2 shared
cores, 784-512-512-10 with batch 64, medians of 10 interleaved repeats were 30.7 vs 28.8
ms and 50.0 vs 56.3 ms per iteration, stock vs fixed, in two sessions: noise). For a model whose forward uses
its layers in another order than they are defined the layout is fixed anyway: the
results stay exact, only the overlap can be worse than a ready-order rebuild.

Why not the ready order itself: it is only known after a backward pass, which needs a
batch and a loss that :func:`~unison.distributed.prepare_model` does not have, and the
one way to hand an order to the Reducer's rebuild without a backward
(``_push_all_rebuilt_params``) pushes the Reducer's parameter list as it is.

Private torch APIs relied on (torch 2.13; ``tests/distributed/test_ddp_resume.py`` pins
each of them and fails loudly when one changes):

- ``DistributedDataParallel._build_params_for_reducer() -> (params, expect_sparse)`` is
  the one source of the Reducer's parameter list (``__init__`` and ``__setstate__``) and
  its indices are the Reducer's indices everywhere (bucket indices, debug names,
  mixed-precision ``_idx``).
- ``Reducer._push_all_rebuilt_params()`` queues every parameter, in the Reducer's order,
  for a rebuild, and ``Reducer._rebuild_buckets()`` rebuilds from that queue (one
  broadcast of the bucket sizes from rank 0), returns True, and never rebuilds again
  (``has_rebuilt_bucket_``); DDP's forward only rebuilds through the same call.
- ``DistributedDataParallel._has_rebuilt_buckets`` mirrors that flag in Python (ZeRO's
  overlap hook reads it).

If a later torch lacks these methods or the rebuild does not happen, the wrap still
works as stock DDP does (it warns); only the bitwise resume at 3+ ranks is lost.

Limits: the rebuild at construction broadcasts the bucket sizes from rank 0 once (DDP's
own rebuild does the same at the first forward), so wrapping stays a collective, also
with ``init_sync=False``; per iteration the collectives are DDP's own, one all-reduce per
bucket. A copy made by pickling or ``copy.deepcopy`` gets a fresh Reducer that behaves
like stock DDP's (it rebuilds after its first backward): fixing it there would put a
collective into ``deepcopy``, which a rank-0-only copy would hang on.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def layout_is_fixable(*, find_unused_parameters: bool, static_graph: bool) -> bool:
    """Whether DDP would rebuild its buckets after the first backward with these settings.

    With ``find_unused_parameters=True`` and no static graph the Reducer never rebuilds:
    its initial layout (1 MiB / 25 MiB caps, reverse definition order) is kept for the
    whole run, so resumed runs are exact already and stock DDP is used.
    """
    return static_graph or not find_unused_parameters


class FixedBucketsDDP(DistributedDataParallel):
    """``DistributedDataParallel`` whose gradient buckets never change after construction.

    Takes exactly DDP's arguments. The Reducer gets the parameters in reverse definition
    order and rebuilds its buckets once, here, instead of after the first backward (see
    the module docstring). Wrapping is a collective: call it on every rank.

    Raises:
        ValueError: with ``find_unused_parameters=True`` and ``static_graph=False``, where
            DDP never rebuilds and plain ``DistributedDataParallel`` is already exact.
    """

    def __init__(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        if not layout_is_fixable(
            find_unused_parameters=bool(kwargs.get("find_unused_parameters", False)),
            static_graph=bool(kwargs.get("static_graph", False)),
        ):
            raise ValueError(
                "FixedBucketsDDP: with find_unused_parameters=True (and no static_graph) DDP "
                "never rebuilds its buckets; use DistributedDataParallel itself."
            )
        super().__init__(module, *args, **kwargs)
        self._fix_buckets()

    def _build_params_for_reducer(self) -> tuple[list[torch.Tensor], list[bool]]:
        """DDP's parameter list for the Reducer, in reverse definition order."""
        parameters, expect_sparse_gradient = super()._build_params_for_reducer()
        self._reducer_order_reversed = True
        return list(reversed(parameters)), list(reversed(expect_sparse_gradient))

    def _fix_buckets(self) -> None:
        """Runs DDP's one-time bucket rebuild now, from the Reducer's (reversed) order."""
        reducer = getattr(self, "reducer", None)
        if reducer is None:  # every parameter's all-reduce is delayed: DDP made no Reducer
            return
        if not getattr(self, "_reducer_order_reversed", False):  # DDP built its Reducer another way
            rebuilt, reason = False, "DDP no longer builds the Reducer's parameters by _build_params_for_reducer()"
        else:
            try:
                reducer._push_all_rebuilt_params()
                rebuilt = bool(reducer._rebuild_buckets())
            except AttributeError as error:  # a torch without these Reducer methods
                rebuilt, reason = False, str(error)
            else:
                reason = "Reducer._rebuild_buckets() returned False"
        if rebuilt:
            self._has_rebuilt_buckets = True
            return
        warnings.warn(
            f"unison could not fix DDP's gradient buckets at construction ({reason}); training "
            "works, but a resumed run at 3 or more ranks may differ from the uninterrupted one "
            "in the last bits. Please report it with your torch version.",
            RuntimeWarning,
            stacklevel=3,
        )
