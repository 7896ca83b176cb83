"""Views of a Plan: its sections as data (`sections`), text (`text`), notebook HTML (`html`),
matplotlib pictures with the pipeline schedule's (`plot`, imported on first use: it loads
matplotlib), number formats (`format`), and measured beside predicted step time (`timing`)."""
from whalex.view.timing import Prediction, StepTiming, predict, time_steps

__all__ = ["Prediction", "StepTiming", "predict", "time_steps"]
