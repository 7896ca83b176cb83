"""The jaxpr layer: `loss_fn` captured into TaskGraphs, the evaluator that inserts a plan's
constraints, segments and repeated blocks, the table of JAX primitives by what they do, FLOP
counting and its rules, compiled-HLO reading, equations' module paths, and batch dependence.

It reads the inputs' layers (`primitives`, `validate`, `errors`, `_compat`) and the record layer
(`records.comm` for HLO's collectives), nothing above (tests/test_imports.py).
"""
