"""Consolidate an AI agent's memories into durable observations with an LLM."""

__version__ = "0.1.0"
