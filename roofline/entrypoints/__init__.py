"""User entry points: the offline ``LLM`` API, the CLI and the OpenAI-compatible server."""
