"""The database functions the engine calls, kept as SQL: one ``.sql`` file per function version.

A function's name carries its version (``consolidation_recall_v1``), as procrastinate does: the
file of a released version is never edited. A change is a new file (``…_v2``) created by a new
migration, which drops the previous version once no release still calls it; the migration that
created a version keeps creating the same text, so ``migrate`` from empty always builds the same
schema. ``store.py`` and ``queue.py`` name the versions they call, in one place each.
"""

from __future__ import annotations

from importlib.resources import files


def read(name: str) -> str:
    """The text of ``consolidation/sql/<name>.sql``."""
    return files(__package__).joinpath(f"{name}.sql").read_text(encoding="utf-8")
