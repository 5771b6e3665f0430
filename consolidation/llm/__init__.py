"""Talking to models: the OpenAI-compatible client and transport, the wire contract (prompts), embeddings and the offline consolidator."""
