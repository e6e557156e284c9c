"""The course's models, data, formulas and plots (no parallelism inside)."""
