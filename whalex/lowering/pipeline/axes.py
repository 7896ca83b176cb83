"""The mesh axes of a pipeline: `data` (pipeline replicas), `stage` (the stages, manual inside
`shard_map`) and, with split TaskGraphs inside the stages, `model` (an auto axis: GSPMD shards the
split layers over it inside a stage)."""
STAGE, DATA, MODEL = "stage", "data", "model"
