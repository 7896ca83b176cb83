"""The linen models after public architectures (tests/public_models: the Llama-style decoder and
the T5-style encoder-decoder) under the plan kinds that annotate them (split, Whale's hybrid,
1F1B and GPipe pipelines, 3D) and the plan options (heterogeneous balance, ZeRO 1 and 3, remat,
micro-batches), each at the smallest batch the plan accepts, against single-device training with
SGD and Adam; a padded batch's token-weighted loss throughout."""
import time
import jax
import optax
import pytest

import whalex as wh
from conftest import adam, assert_matches
from public_models import annotate, llama, t5

MODELS = {"llama": llama.problem, "t5": t5.problem}
SPEEDS = [3.0] * 4 + [1.0] * 4


def _hetero():
    return wh.Cluster.detect().with_speeds([s * 1e12 for s in SPEEDS])


# plan kind -> (annotations, Config, cluster, batch, optimizer, the program kind it builds)
PLANS = {
    "split": (annotate.TENSOR_PARALLEL, wh.Config(), None, 8, "sgd", "Program"),
    "hybrid": (annotate.HYBRID, wh.Config(), None, 8, "adam", "Program"),
    "1f1b": (annotate.STAGES, wh.Config(num_micro_batch=2), None, 8, "sgd", "PipelineProgram"),
    "gpipe": (annotate.STAGES, wh.Config(num_micro_batch=2, schedule="gpipe"), None, 8, "adam", "PipelineProgram"),
    "3d": (annotate.MLP_SPLIT, wh.Config(auto_parallel=True, num_task_graph=2, num_micro_batch=2), None, 4, "sgd",
           "PipelineProgram"),
    "hetero": (annotate.none, wh.Config(hardware_aware=True), _hetero, 8, "adam", "UnevenProgram"),
    "zero 1": (annotate.none, wh.Config(zero_level=1), None, 8, "adam", "Program"),
    "zero 3": (annotate.none, wh.Config(zero_level=3), None, 8, "sgd", "UnevenProgram"),
    "remat full": (annotate.none, wh.Config(remat="full"), None, 8, "adam", "Program"),
    "micro-batches": (annotate.none, wh.Config(num_micro_batch=4), None, 32, "sgd", "Program"),
}


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("model", list(MODELS))
def test_plan_trains_as_one_device(model, plan):
    where, config, cluster, batch, opt, kind = PLANS[plan]
    t = time.time()
    loss_fn, params, data = MODELS[model](batch=batch, where=where)
    optimizer = optax.sgd(0.3) if opt == "sgd" else adam()
    cluster = cluster() if cluster else wh.Cluster.detect()
    step, _ = assert_matches(loss_fn, params, data, steps=2, optimizer=optimizer, config=config, cluster=cluster)
    print(model, plan, step.plan.program_kind, step.plan.batch_sizes, time.time() - t)
    assert step.plan.program_kind == kind
