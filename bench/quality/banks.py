"""The labelled banks of the quality benchmark. Pure: no I/O but reading the bank files.

A bank file is the real-model lane's format (bench/data/realmodel_bank.json) with two optional
additions the lane ignores: ``held_out`` (a bank no prompt or threshold is tuned against) and,
per label, ``distinct_from`` (hard negatives: labels whose facts look alike but must stay in
different observations).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import orjson

from bench.realmodel.report import BANK_FILE, Bank, load_bank

BANKS_DIR = Path(__file__).resolve().parent / "banks"
DEFAULT_BANK_FILES = (
    BANK_FILE,
    BANKS_DIR / "ops_team.json",
    BANKS_DIR / "household_diary.json",
    BANKS_DIR / "bookshop.json",
    BANKS_DIR / "smallholding.json",
    BANKS_DIR / "clinic.json",
)


@dataclass(frozen=True)
class QualityBank:
    """A lane bank plus what only the quality judge reads."""

    path: Path
    bank: Bank
    held_out: bool
    hard_negatives: tuple[tuple[str, str], ...]  # label pairs, each pair once, sorted

    @property
    def name(self) -> str:
        return self.bank.bank_id

    @property
    def perfect_observations(self) -> int:
        """What a perfect answer leaves: one observation per label."""
        return len(self.bank.labels)

    def label_of_text(self) -> dict[str, str]:
        return {m.text: m.label for m in self.bank.memories}


def load_quality_bank(path: Path) -> QualityBank:
    bank = load_bank(path)
    data = orjson.loads(path.read_bytes())
    pairs: set[tuple[str, str]] = set()
    for name, spec in data["labels"].items():
        for other in spec.get("distinct_from", ()):
            if other not in bank.labels:
                raise ValueError(f"{path}: label {name!r} is distinct_from unknown {other!r}")
            a, b = sorted((name, other))
            pairs.add((a, b))
    return QualityBank(
        path=path,
        bank=bank,
        held_out=bool(data.get("held_out", False)),
        hard_negatives=tuple(sorted(pairs)),
    )


def load_banks(paths: tuple[Path, ...] = DEFAULT_BANK_FILES) -> tuple[QualityBank, ...]:
    banks = tuple(load_quality_bank(p) for p in paths)
    names = [b.name for b in banks]
    if len(set(names)) != len(names):
        raise ValueError(f"bank ids must differ: {names}")
    return banks
