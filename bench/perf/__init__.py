"""Schedule, throughput, lag and memory of the engine against the fake LLM."""
