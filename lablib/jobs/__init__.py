"""Running a step: torchrun from a notebook, the process environment, run scripts' skeleton, several nodes."""
