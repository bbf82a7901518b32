"""Benchmarks that print every figure beside the roofline measured in the same run."""
