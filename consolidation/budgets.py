"""Per-bank token budgets in the database: the tokens each closed wave used, a bank's own budget,
the rolling 24 h window's usage and when it frees enough (DESIGN §10, ``BANK_TOKEN_BUDGET``)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

import asyncpg

from consolidation import queue

WINDOW_S = 24 * 3600.0
# How a paused operation's error starts: the API, the dashboard and a budget change find it so.
PAUSE_PREFIX = "paused: token budget"

_IN_WINDOW = "used_at > now() - interval '24 hours'"

RECORD = f"""
WITH pruned AS (
    DELETE FROM bank_token_usage WHERE bank_id = $1 AND NOT ({_IN_WINDOW})
), added AS (
    INSERT INTO bank_token_usage (bank_id, operation_id, tokens) VALUES ($1, $2, $3)
    RETURNING tokens
)
SELECT (SELECT token_budget FROM banks WHERE id = $1) AS bank_budget,
       (SELECT tokens FROM added)
       + COALESCE((SELECT sum(tokens) FROM bank_token_usage WHERE bank_id = $1 AND {_IN_WINDOW}),
                  0) AS used
"""

WINDOW = f"""
SELECT b.token_budget AS bank_budget,
       COALESCE((SELECT sum(u.tokens) FROM bank_token_usage u
                 WHERE u.bank_id = b.id AND u.{_IN_WINDOW}), 0) AS used
FROM banks b WHERE b.id = $1
"""

# The window frees enough once its usage is below the budget: the rows leave it oldest first, so
# that is 24 h after the oldest row whose newer rows alone sum to less than the budget.
FREES_AT = f"""
WITH w AS (
    SELECT used_at,
           COALESCE(sum(tokens) OVER (ORDER BY used_at DESC, id DESC
                                      ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0)
               AS newer
    FROM bank_token_usage WHERE bank_id = $1 AND {_IN_WINDOW}
)
SELECT CASE WHEN COALESCE((SELECT sum(tokens) FROM bank_token_usage
                           WHERE bank_id = $1 AND {_IN_WINDOW}), 0) < $2 THEN now()
            ELSE (SELECT min(used_at) + interval '24 hours' FROM w WHERE newer < $2) END
"""

SET_BANK_BUDGET = """
INSERT INTO banks (id, token_budget) VALUES ($1, $2)
ON CONFLICT (id) DO UPDATE SET token_budget = EXCLUDED.token_budget
"""

# A budget changed: the bank's paused operations look again now (pausing again if still over).
WAKE_PAUSED = f"""
UPDATE operations SET run_after = now()
WHERE bank_id = $1 AND status = 'pending' AND run_after > now() AND error LIKE '{PAUSE_PREFIX}%'
RETURNING id
"""


@dataclass(frozen=True)
class Window:
    """A bank's budget (``limit``, None = no limit; ``source`` says whose) and the tokens its
    consolidations used in the last 24 hours."""

    limit: int | None
    source: Literal["bank", "setting", "none"]
    used: int

    @property
    def exhausted(self) -> bool:
        return self.limit is not None and self.used >= self.limit


def _window(bank_budget: int | None, setting: int | None, used: int) -> Window:
    if bank_budget is not None:
        return Window(int(bank_budget), "bank", int(used))
    if setting is not None:
        return Window(setting, "setting", int(used))
    return Window(None, "none", int(used))


async def record_usage(
    pool: asyncpg.Pool, bank_id: str, operation_id: object, tokens: int, setting: int | None
) -> Window:
    """Record ``tokens`` used now by an operation of ``bank_id``; the bank's window after it."""
    row = await pool.fetchrow(RECORD, bank_id, operation_id, tokens)
    return _window(row["bank_budget"], setting, row["used"])


async def window(
    pool: asyncpg.Pool | asyncpg.Connection, bank_id: str, setting: int | None
) -> Window | None:
    """The bank's budget and its usage in the last 24 hours; None for an unknown bank."""
    row = await pool.fetchrow(WINDOW, bank_id)
    if row is None:
        return None
    return _window(row["bank_budget"], setting, row["used"])


async def frees_at(
    pool: asyncpg.Pool | asyncpg.Connection, bank_id: str, limit: int
) -> datetime | None:
    """When the bank's usage in the window falls below ``limit`` (now when it is below already);
    None when it never does (a budget of 0)."""
    value: datetime | None = await pool.fetchval(FREES_AT, bank_id, limit)
    return value


async def set_bank_budget(pool: asyncpg.Pool, bank_id: str, tokens: int | None) -> None:
    """Set the bank's own budget (None: back to the setting), creating the bank if needed; its
    paused operations are due again at once, to be checked against the new budget."""
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute(SET_BANK_BUDGET, bank_id, tokens)
        woken = await conn.fetch(WAKE_PAUSED, bank_id)
        if woken:
            await conn.execute("SELECT pg_notify($1, $2)", queue.NOTIFY_SUBMIT, bank_id)
