"""The real-model lane: llama-cpp-python and a GGUF from a registry package."""
