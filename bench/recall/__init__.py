"""Recall quality: full text against hybrid, with all-MiniLM-L6-v2 on CPU."""
