"""Where a plan's annotations go in the suite's models. A model takes `where`, a function from a
part's name to a context manager, and enters `where(part)` around each part, so the same model
trains un-annotated (data parallel, ZeRO, pipelines cut by auto_parallel) or with
`replicate`/`split` where a plan asks. Parts: "attention", "mlp", "layer" (a whole block, for
pipeline stages) and "head" (the output projection)."""
import contextlib

import whalex as wh


def none(part):
    """No annotation anywhere: the default strategy for every operation."""
    return contextlib.nullcontext()


def of(**parts):
    """A scope function putting each named part under its primitive factory, e.g.
    `of(attention=lambda: wh.split(2), mlp=lambda: wh.split(2))`; other parts stay un-annotated."""
    def scope(part):
        make = parts.get(part)
        return make() if make else contextlib.nullcontext()
    return scope


TENSOR_PARALLEL = of(attention=lambda: wh.split(2), mlp=lambda: wh.split(2))   # Megatron layers
HYBRID = of(layer=lambda: wh.replicate(8), head=lambda: wh.split(8))          # Whale's Example 2
STAGES = of(layer=lambda: wh.replicate(1))                                     # one stage per block
MLP_SPLIT = of(mlp=lambda: wh.split(2))                                        # inside pipeline stages
