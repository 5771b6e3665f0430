"""Alembic migrations for the consolidation schema (DESIGN §5)."""
