"""Training: the shared loop, its extensions and checkpoints, distribution, precision, loggers, schedules, objectives and losses."""
