"""Per-rank memory: the plan before a run, and the model state a rank holds, counted."""
