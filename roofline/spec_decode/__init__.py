"""Speculative decoding: proposers (n-gram, draft model, oracle), the verifier (exact
rejection sampling), the adaptive switch and the metrics. See ``docs/architecture.md``."""
