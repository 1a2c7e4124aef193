"""unison/recipe/build/preflight.py: the checks made before the ranks start leave nothing behind in a
process that then trains. A data builder that caches its tokenised corpus (an lru_cache) and a model
whose vocabulary size comes from that corpus (pytorch/examples' word_language_model, ported as a new
user would) train in one process and under torchrun: the model is not built on the meta device
there, so the cache never holds meta tensors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _procs import run_in_session

from unison.recipe.phases import run

TORCHRUN_TIMEOUT_S = 240

MODULE = '''
import functools

import torch
from torch import nn
from torch.utils.data import Dataset

TEXT = "the quick brown fox jumps over the lazy dog and the cat sat on the mat " * 8


@functools.lru_cache(maxsize=None)
def corpus():
    """The tokenised corpus, read once per process: its ids and its vocabulary."""
    words = TEXT.split()
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    return torch.tensor([vocab[w] for w in words], dtype=torch.long), vocab


class NextWord(Dataset):
    def __init__(self, ids, context=3):
        self.ids, self.context = ids, context

    def __len__(self):
        return len(self.ids) - self.context

    def __getitem__(self, i):
        return self.ids[i : i + self.context], self.ids[i + self.context]


def data(seed):
    ids, _ = corpus()
    cut = int(len(ids) * 0.8)
    return NextWord(ids[:cut]), NextWord(ids[cut:])


class WordModel(nn.Module):
    def __init__(self, hidden=8):
        super().__init__()
        ntokens = len(corpus()[1])  # the vocabulary size, from the cached corpus
        self.embed = nn.Embedding(ntokens, hidden)
        self.out = nn.Linear(hidden, ntokens)

    def forward(self, x):
        return self.out(self.embed(x).mean(1))
'''

CONFIG = """name: words
model: {{type: !pyobject words_user.WordModel}}
data: {{build: !pyobject words_user.data}}
training:
  max_epochs: 1
  batch_size: 16
  loss: !pyobject torch.nn.functional.cross_entropy
  optimizer_type: !pyobject torch.optim.SGD
  optimizer_kwargs: {{lr: 0.1}}
validation: {{metrics: {{loss: !pyobject unison.metrics.Loss}}}}
checkpoint: {{enabled: false}}
logging: {{root: {root}, progress: false}}
"""


def _config(folder: Path) -> Path:
    (folder / "words_user.py").write_text(MODULE)
    path = folder / "config.yaml"
    path.write_text(CONFIG.format(root=folder / "runs"))
    return path


def test_a_cached_corpus_trains_in_the_process_that_checked_the_config(tmp_path: Path) -> None:
    results = run(_config(tmp_path))  # no launcher, no --nproc: this process is the one rank
    assert results["iterations"] == 7 and results["validation"]["loss"] > 0


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(TORCHRUN_TIMEOUT_S + 30)
def test_a_cached_corpus_trains_under_torchrun(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "unison", "run", str(_config(tmp_path)),
    ]  # fmt: skip
    result = run_in_session(cmd, TORCHRUN_TIMEOUT_S, tmp_path)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    (run_dir,) = (tmp_path / "runs" / "words").iterdir()
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert (metrics["world_size"], metrics["iterations"]) == (2, 4)
