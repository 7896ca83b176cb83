"""Numeric precision as transforms of the step: mixed precision (`Config.amp`: the loss computed in
bf16/fp16 over fp32 master weights, `amp`), dynamic loss scaling for fp16 (`loss_scale`), and gradient
all-reduces in a half dtype (`Config.comm_dtype`, `comm`). Capture knows none of them: the planner
applies amp to the loss function and to its capture (`amp.sink_casts`), lowering applies the others
to the step it builds. The options themselves are a record (`whalex.records.memory_options.Precision`)."""
