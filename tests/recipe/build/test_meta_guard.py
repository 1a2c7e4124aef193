"""unison/recipe/build/meta_guard.py: a meta tensor that still reaches training (here one the user's module
made on the meta device itself and cached) fails at its first iteration with a message that says
what a meta tensor is, where one comes from and what to do, keeping torch's own error as the cause."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_preflight import _config

from unison.recipe.phases import run


def test_a_meta_tensor_that_still_reaches_training_is_named_with_its_cause(tmp_path: Path) -> None:
    """A corpus the user's module made on the meta device itself and cached: the first iteration's
    error says what a meta tensor is, where one comes from and what to do, and keeps torch's."""
    path = _config(tmp_path)
    module = tmp_path / "words_user.py"
    module.write_text(
        module.read_text()
        .replace(
            "    words = TEXT.split()\n", '    torch.set_default_device("meta")\n    words = TEXT.split()\n'
        )
        .replace("    return torch.tensor(", "    ids = torch.tensor(")
        .replace(
            "dtype=torch.long), vocab",
            'dtype=torch.long)\n    torch.set_default_device("cpu")\n    return ids, vocab',
        )
    )
    with pytest.raises(RuntimeError) as info:
        run(path)
    message = str(info.value)
    assert message.startswith("training met a tensor on the meta device"), message
    assert "lru_cache" in message and "iteration 1" in message, message
    assert "Cannot copy out of meta tensor" in str(info.value.__cause__)
