"""What every kind of plan needs: the planning request, checks of its inputs, captures at other
batch sizes, and the loss contract over parts (the Plan itself is assembled in `assemble.py`)."""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from whalex.errors import PlanError
from whalex.jaxpr.capture import capture as capture_loss, dtype_of
from whalex.loss.align import align
from whalex.loss.analysis import WAY_OUT, analyse
from whalex.loss.evaluation import PartLoss
from whalex.memory.remat import configure
from whalex.mesh.cluster import Cluster
from whalex.planner.xla_fit import fit_compiled
from whalex.precision.amp import AmpLoss, sink_casts
from whalex.primitives.config import DEFAULTS, Config


@dataclasses.dataclass(frozen=True, eq=False)
class Request:
    """What a plan is built for: the loss (amp already applied), example inputs, optimizer,
    Config and Cluster (both resolved)."""

    loss_fn: Callable
    params: Any
    batch: Any
    inputs: dict                 # model_state / rng, where given: the loss's keyword inputs
    has_aux: bool
    optimizer: optax.GradientTransformation | None
    config: Config
    cluster: Cluster

    def capture(self, rows: int | None = None):
        """The loss captured at the example batch, or at `rows` samples (abstract shapes), aligned
        with the example batch's trace (`whalex.loss.align`: identities JAX left out put back)."""
        if rows is None:
            return self.whole
        part = capture(self.loss_fn, self.params, micro_batch(self.batch, rows), self.has_aux, self.inputs)
        return align(part, self.whole)

    @functools.cached_property
    def whole(self):
        """The loss captured at the example batch."""
        return capture(self.loss_fn, self.params, self.batch, self.has_aux, self.inputs)


def capture(loss_fn: Callable, params, batch, has_aux: bool, inputs: dict):
    """The loss captured (`whalex.jaxpr.capture`), then amp's transform of the capture where the loss is
    an `AmpLoss`: its input casts moved next to their first use."""
    cap = capture_loss(loss_fn, params, batch, has_aux=has_aux, **inputs)
    return sink_casts(cap) if isinstance(loss_fn, AmpLoss) else cap


def configure_memory(program, config, cluster, batch_axes=(), recapture=None):
    """`program` with the precision and remat records of `config` (whalex.memory.remat.configure decides
    them from the capture, the mesh and the stored state's layout)."""
    prec, remat = configure(program.captured, dict(program.mesh.shape), program.state_layout(), config, cluster,
                            batch_axes, recapture)
    program = dataclasses.replace(program, precision=prec, remat=remat if remat is not None else program.remat)
    if config.remat == "auto" and cluster.compile_only:
        program = fit_compiled(program, config, cluster, batch_axes, recapture)
    return program


def resolve(config, cluster) -> tuple[Config, Cluster]:
    config = config if config is not None else (DEFAULTS.config or Config())
    if not isinstance(config, Config):
        config = Config(config)
    cluster = cluster if cluster is not None else (DEFAULTS.cluster or Cluster.detect())
    if not isinstance(cluster, Cluster):
        raise PlanError(f"cluster must be a wh.Cluster, got {type(cluster).__name__}; use wh.Cluster.detect().")
    # an abstract cluster of GPU kinds plans on its XLA:GPU twin where JAX's CUDA plugin is installed, so that
    # remat="auto", memory_fit() and step_memory() read XLA:GPU's figure; offload on a GPU topology lowers over
    # an abstract mesh, where its shardings keep the host memory kind
    twin = cluster.compile_twin()
    cluster = twin if twin is not None else cluster
    if config.offload and cluster.compile_only and not cluster.is_abstract:
        cluster = cluster.over_abstract_mesh()
    return config, cluster


def check_optimizer(optimizer):
    if optimizer is not None and not isinstance(optimizer, optax.GradientTransformation):
        raise PlanError(f"optimizer must be an optax.GradientTransformation (e.g. optax.adam(1e-3)), "
                        f"got {type(optimizer).__name__}.")


def micro_batch(batch, size):
    """Abstract leaves of `batch` with `size` rows."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((size,) + tuple(np.shape(x)[1:]), dtype_of(x)), batch)


def loss_parts(part, whole, config, context, way_out=WAY_OUT):
    """The loss contract over parts of `part.global_batch` samples (analysed against the whole batch;
    `way_out`: what the error offers where the traces differ)."""
    per_part = config.batch_coupling == "per_part"
    if part.global_batch == whole.global_batch:
        sem = analyse(whole, whole, per_part=per_part, context=context, way_out=way_out)
    else:
        sem = analyse(part, whole, per_part=per_part, context=context, way_out=way_out)
    return PartLoss(sem, part, whole)

