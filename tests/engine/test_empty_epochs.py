"""An epoch in which no rank got a batch fails on every rank, naming the data
(unison/engine/empty_epochs.py): a stream that yields nothing is refused as ignite refuses
empty data with a length, instead of training 0 iterations and reporting a loss of nan."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from unison.distributed import get_rank, shard_stream
from unison.engine import Engine, create_trainer
from unison.engine.empty_epochs import EmptyDataError
from unison.testing import run_distributed


class Rows(IterableDataset):
    """``size`` rows of a 2-feature regression, read again from the start each epoch."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self):
        for i in range(self.size):
            yield torch.tensor([float(i), 1.0]), torch.tensor([float(i)])


def _trainer() -> Engine:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    return create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), torch.nn.functional.mse_loss)


def _train(size: int, equal_length: bool = True, max_epochs: int = 2) -> str | int:
    """The error's message, or the iterations trained."""
    loader = DataLoader(shard_stream(Rows(size), equal_length=equal_length), batch_size=1)
    try:
        return _trainer().run(loader, max_epochs=max_epochs).iteration
    except EmptyDataError as err:
        return str(err)


def test_a_stream_that_yields_nothing_fails_at_one_rank() -> None:
    message = _train(0)
    assert isinstance(message, str), f"trained {message} iterations on an empty stream"
    assert "no batch" in message and "epoch 1" in message and "Rows" in message
    assert _train(3) == 6  # a stream with rows trains as before


def test_an_evaluator_over_an_empty_stream_fails_as_over_empty_data_with_a_length() -> None:
    engine = Engine(lambda engine, batch: None, name="evaluator")
    with pytest.raises(EmptyDataError, match="evaluator: .*no batch") as err:
        engine.run(DataLoader(Rows(0), batch_size=1))
    assert err.value.engine_name == "evaluator"


def _rank(size: int, equal_length: bool, max_epochs: int) -> tuple[int, str | int]:
    return get_rank(), _train(size, equal_length, max_epochs)


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_every_rank_fails_alike_when_no_rank_got_a_batch() -> None:
    ranks = run_distributed(_rank, 0, True, 2, nproc=2, timeout=100)
    assert all(isinstance(message, str) and "on every rank (2 of 2)" in message for _, message in ranks), (
        ranks
    )
    # One rank without a batch while another has one is shard_stream's unequal length: no error.
    ranks = run_distributed(_rank, 1, False, 1, nproc=2, timeout=100)
    assert [trained for _, trained in ranks] == [1, 0], ranks
