"""Capacity planner and serving simulator: the roofline model of an engine step (the one
``roofline bench`` reports against), memory/parallelism/cost/speculative-decoding calculators,
and a discrete-event simulator that drives roofline's real scheduler. See ``docs/planner.md``.
"""
