"""Scoring models: held-out answers, their metrics, preference accuracy, and the lm-eval bridge."""
