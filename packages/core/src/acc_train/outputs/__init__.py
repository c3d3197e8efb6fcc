"""What a run leaves: metrics.jsonl, the report and its plot, trackers, the model card, MFU, samples, the run lock."""
