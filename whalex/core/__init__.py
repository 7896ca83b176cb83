"""What every layer above reads: capture into TaskGraphs, the jaxpr evaluator, the loss contract
(parts: the analysis; part_loss: the evaluation in parts), and small shared data (planned
collectives, optimizer-state specs, named calls).

Bottom of whalex's layering: it imports only `primitives`, `state`, `errors` and `_compat`, never
balance, memory, lowering, planner or moe (see tests/project/test_imports.py); `program.py`'s contract
names memory's `Precision` and `RematPlan` records for type checkers only.
"""
