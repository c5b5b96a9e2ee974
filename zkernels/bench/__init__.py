"""Microbenchmarks: `python -m zkernels.bench` runs the sections; each section module exposes
``run(args) -> list[dict]``."""
