"""Per-rank memory: the plan before a run (and the planner a strategy hands out for it), and the model state a rank holds, counted."""
