"""Attention backends over the paged KV cache and the metadata that drives them."""
