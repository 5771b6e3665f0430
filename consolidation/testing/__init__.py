"""Tooling shipped for users' tests: the fake LLM and embeddings servers.

``fake_llm`` is the server and the names callers import (``FakeLLMServer``, ``FakeLLMConfig``,
``create_app``, ``serve``); behind it ``config`` (what the fake is told to do, the plan of each
request, latency), ``requests`` (reading a chat request), ``answers`` (what it answers, refusals
per dialect), ``serving`` (answering at the planned time), ``stats`` (the tally of calls),
``embeddings`` (``/v1/embeddings``) and ``fake_embeddings`` (its deterministic vectors).
"""
