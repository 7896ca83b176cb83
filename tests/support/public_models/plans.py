"""The plan kinds the public-model suite trains under: each is the model's annotations
(public_models.annotate), a Config, a cluster, the smallest global batch the plan accepts on 8
devices, an optimizer it is checked with (SGD or Adam) and the program kind it builds."""
import dataclasses
from collections.abc import Callable

import optax

import whalex as wh
from conftest import adam
from support.public_models import annotate

SPEEDS = [3e12] * 4 + [1e12] * 4        # measured-looking speeds: 3:1, as V100 to T4


@dataclasses.dataclass(frozen=True)
class Plan:
    where: Callable
    config: wh.Config
    batch: int
    optimizer: str
    program: str
    hetero: bool = False

    def cluster(self):
        cluster = wh.Cluster.detect()
        return cluster.with_speeds(SPEEDS) if self.hetero else cluster

    def make_optimizer(self):
        return optimizer(self.optimizer)


def optimizer(name):
    """"sgd" or "adam", at the rates the suite trains with."""
    return optax.sgd(0.3) if name == "sgd" else adam()


PLANS = {
    # tensor parallel: attention and MLP under split(2), the rest data parallel over 8 devices
    "split": Plan(annotate.TENSOR_PARALLEL, wh.Config(), 8, "sgd", "Program"),
    "hybrid": Plan(annotate.HYBRID, wh.Config(), 8, "adam", "Program"),
    # one stage per block, 4 pipeline replicas, 2 micro-batches of one row per replica
    "1f1b": Plan(annotate.STAGES, wh.Config(num_micro_batch=2), 8, "sgd", "PipelineProgram"),
    "gpipe": Plan(annotate.STAGES, wh.Config(num_micro_batch=2, schedule="gpipe"), 8, "adam", "PipelineProgram"),
    # data 2 x stage 2 x model 2: auto_parallel cuts 2 stages, MLPs split(2) inside them
    "3d": Plan(annotate.MLP_SPLIT, wh.Config(auto_parallel=True, num_task_graph=2, num_micro_batch=2), 4, "sgd",
               "PipelineProgram"),
    # on the 3:1 cluster, rows in proportion to speed: 16 is the smallest batch that leaves a slow device
    # any (one row each; at 8 they get none)
    "hetero": Plan(annotate.none, wh.Config(hardware_aware=True), 16, "adam", "UnevenProgram", hetero=True),
    # Whale's hybrid there: the replicated blocks' rows balanced, the head split
    "hetero hybrid": Plan(annotate.HYBRID, wh.Config(hardware_aware=True), 16, "sgd", "HybridProgram", hetero=True),
    "zero 1": Plan(annotate.none, wh.Config(zero_level=1), 8, "adam", "Program"),
    "zero 3": Plan(annotate.none, wh.Config(zero_level=3), 8, "sgd", "UnevenProgram"),
    "remat full": Plan(annotate.none, wh.Config(remat="full"), 8, "adam", "Program"),
    # gradient accumulation: 4 micro-batches, each divided over the 8 replicas
    "micro-batches": Plan(annotate.none, wh.Config(num_micro_batch=4), 32, "sgd", "Program"),
}
