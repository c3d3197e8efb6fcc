"""Evaluation: the evaluators a run calls, and loading a trained model for eval, generate and export."""
