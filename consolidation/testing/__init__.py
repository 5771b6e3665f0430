"""Tooling shipped for users' tests: the fake LLM and embeddings servers."""
