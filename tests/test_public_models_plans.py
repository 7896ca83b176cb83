"""The linen models after public architectures (tests/public_models: the Llama-style decoder and
the T5-style encoder-decoder) under the plan kinds that annotate them (split, Whale's hybrid, 1F1B
and GPipe pipelines, 3D) and the plan options (heterogeneous balance, ZeRO 1 and 3, remat,
micro-batches), each at the smallest batch the plan accepts, against single-device training with
SGD and Adam; a padded batch's token-weighted loss throughout."""
import pytest

from conftest import assert_matches
from public_models import llama, t5
from public_models.plans import PLANS

MODELS = {"llama": llama.problem, "t5": t5.problem}


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("model", list(MODELS))
def test_plan_trains_as_one_device(model, plan):
    p = PLANS[plan]
    loss_fn, params, data = MODELS[model](batch=p.batch, where=p.where)
    step, _ = assert_matches(loss_fn, params, data, steps=2, optimizer=p.make_optimizer(), config=p.config,
                             cluster=p.cluster())
    assert step.plan.program_kind == p.program
    if p.where is not None and plan in ("split", "hybrid", "3d"):
        assert any(t.strategy.startswith("split") for t in step.plan.task_graphs)
    if p.hetero:
        assert step.plan.batch_sizes[0] > step.plan.batch_sizes[-1] and sum(step.plan.batch_sizes) == p.batch
