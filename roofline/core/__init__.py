"""Scheduling and KV-page bookkeeping: pure Python, no torch."""
