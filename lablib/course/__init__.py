"""The course's models, data, formulas, training loop and plots (no parallelism inside)."""
