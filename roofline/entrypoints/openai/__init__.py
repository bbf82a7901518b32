"""The OpenAI-compatible HTTP server: protocol models, handlers, metrics and its CLI."""
