"""Plain records the layers hand each other: the step program's contract and what it hands the
layers below lowering (`program`: state layout, traced step), the memory options it carries
(`memory_options`: ZeRO and offload, precision, remat), the sharding patterns' decisions
(`sharding_plan`), pipeline schedules (`schedules`), planned collectives and their cost (`comm`),
and the names of the calls whalex recognises (`call_names`).

The bottom of whalex's own layers: it reads only `state`, `errors` and `primitives.config`, never a
layer above it (tests/test_imports.py); the contract names the jaxpr and loss records it carries
(`Captured`, `PartLoss`) for type checkers only.
"""
