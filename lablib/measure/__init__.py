"""Measuring what happened: step time, collectives and their bytes, memory, point-to-point traffic."""
