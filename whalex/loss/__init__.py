"""The loss contract (docs/architecture.md#the-loss-contract): a loss evaluated in parts keeps its
whole-batch meaning. `analysis` decides per reduction how its partial results combine, `evaluation`
runs the loss in parts, `random_rows` draws a part's rows of a global random draw, and `align` sets
two traces of one loss side by side. It sits on the jaxpr layer and reads nothing above it.
"""
