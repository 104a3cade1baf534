"""Anthropic's Messages API over the chat handler (protocol.py, serving.py)."""
