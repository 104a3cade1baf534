"""User entry points: the CLI and (later) the OpenAI-compatible server."""
