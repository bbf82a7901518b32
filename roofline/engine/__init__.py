"""The engine: the step loop, the async wrapper for the server, incremental detokenization."""
