"""unison/recipe/planning/lr_plan.py with a global batch size: the global batch, and so the learning rate,
is the same at every world size (the truth: the plan at one rank)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from unison.config import Config, to_plain
from unison.config.schema import LRScalingConfig
from unison.handlers import scale_lr
from unison.recipe.planning.lr_plan import lr_plan, plan_of


@given(
    per_rank=st.integers(1, 8),
    accumulation=st.integers(1, 4),
    world=st.sampled_from([1, 2, 3, 4, 6, 12]),
    reference=st.one_of(st.none(), st.integers(1, 512)),
)
def test_a_global_batch_scales_the_learning_rate_alike_at_every_world_size(
    per_rank: int, accumulation: int, world: int, reference: int | None
) -> None:
    c = Config()
    c.training.batch_size = None
    c.training.global_batch_size = total = per_rank * 12 * accumulation  # divides over every world drawn
    c.training.accumulation_steps = accumulation
    c.training.lr_scaling = LRScalingConfig(rule="linear", reference_batch_size=reference)
    truth = lr_plan(c, 1)
    for plan in (lr_plan(c, world), truth.at(world), plan_of(to_plain(c.training), world)):
        assert plan.global_batch == total and plan.reference_batch == (reference or total)
        assert plan.batch_size * world * accumulation == total  # each rank's share, as logged
        assert scale_lr(1.0, plan.rule, plan.global_batch, plan.reference_batch) == scale_lr(
            1.0, truth.rule, truth.global_batch, truth.reference_batch
        )


def test_a_per_rank_batch_size_still_grows_the_global_batch_with_the_ranks() -> None:
    c = Config()
    c.training.batch_size, c.training.accumulation_steps, c.training.lr_scaling = 8, 2, "linear"
    assert [(p.global_batch, p.reference_batch) for p in (lr_plan(c, 1), lr_plan(c, 3))] == [
        (16, 16),
        (48, 16),
    ]
    assert lr_plan(c, 1).at(3) == lr_plan(c, 3)
