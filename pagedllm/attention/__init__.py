"""Paged attention: metadata, backend interface + registry, the Attention layer."""
