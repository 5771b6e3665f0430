"""The real-model lane's figures and verdicts, from the operation's PerfLog, the engine's log
events and the observations left in the database. Pure: no I/O but reading the bank file.

The judgement is deliberately simple and checkable by eye: an observation "belongs" to the labels
of the memories it cites; a duplicates label should end as exactly one observation, a state
change as observations that name the new state and none that name only the old one, a single
fact as at least one observation citing it and nothing unrelated.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

BANK_FILE = Path(__file__).resolve().parents[1] / "data" / "realmodel_bank.json"
# Memory ids are derived from the bank's keys, so the lane can map observations back to labels.
_ID_NAMESPACE = uuid.UUID("5b7e1c1e-8f0b-4a8e-9a51-2f1d4c6b7a10")


@dataclass(frozen=True)
class LabelledMemory:
    key: str
    label: str
    id: uuid.UUID
    text: str
    tags: tuple[str, ...]
    occurred_at: str | None


@dataclass(frozen=True)
class Label:
    name: str
    kind: str  # duplicates | state_change | fact
    expect: str
    current: tuple[str, ...] = ()
    previous: tuple[str, ...] = ()


@dataclass(frozen=True)
class Bank:
    bank_id: str
    labels: dict[str, Label]
    memories: tuple[LabelledMemory, ...]

    def jsonl(self) -> bytes:
        """The bank as `consolidation ingest` reads it: labels stay here, never in the database."""
        lines = [
            orjson.dumps(
                {
                    "id": str(m.id),
                    "text": m.text,
                    "tags": list(m.tags),
                    "occurred_at": m.occurred_at,
                }
            )
            for m in self.memories
        ]
        return b"\n".join(lines) + b"\n"


def load_bank(path: Path = BANK_FILE) -> Bank:
    data = orjson.loads(path.read_bytes())
    labels = {
        name: Label(
            name=name,
            kind=spec["kind"],
            expect=spec["expect"],
            current=tuple(spec.get("current", ())),
            previous=tuple(spec.get("previous", ())),
        )
        for name, spec in data["labels"].items()
    }
    memories = tuple(
        LabelledMemory(
            key=m["key"],
            label=m["label"],
            id=uuid.uuid5(_ID_NAMESPACE, m["key"]),
            text=m["text"],
            tags=tuple(m.get("tags", ())),
            occurred_at=m.get("occurred_at"),
        )
        for m in data["memories"]
    )
    unknown = sorted({m.label for m in memories} - labels.keys())
    if unknown:
        raise ValueError(f"{path}: memories with labels not in 'labels': {unknown}")
    return Bank(bank_id=data["bank"], labels=labels, memories=memories)


# --- LLM figures ------------------------------------------------------------------------------


def _number(perf: Mapping[str, Any], key: str) -> float:
    value = perf.get(key, 0)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def _ratio(numerator: float, denominator: float) -> float | None:
    return round(numerator / denominator, 3) if denominator else None


def llm_figures(
    perf: Mapping[str, Any], events: Mapping[str, int], *, completed: bool = True
) -> dict[str, Any]:
    """Calls, first-try validity and repairs of one operation.

    Every LLM call is either a pass's first try or a repair (a retry after an unusable answer);
    ``llm_failures`` counts every unusable answer, first try or repair. A pass whose first answer
    is unusable logs ``unusable_answer_retry`` before its repair (before and after the repair
    counters existed), so that line counts first-try failures; repairs come from the PerfLog's
    ``llm_repairs`` / ``llm_repaired`` when the engine has them, else one per such line.

    An operation that did not complete may end on a call that got no answer (``partial``); when
    no answer came at all (no tokens, no unusable answer), validity is unknown, not perfect.
    """
    calls = _number(perf, "llm_calls")
    failures = _number(perf, "llm_failures")
    memories = _number(perf, "memories")
    first_try_failures = float(events.get("unusable_answer_retry", 0))
    if "llm_repairs" in perf:
        repairs = _number(perf, "llm_repairs")
        repaired = _number(perf, "llm_repaired")
        source = "perf"
    else:
        repairs = first_try_failures
        repaired = max(0.0, repairs - (failures - first_try_failures))
        source = "log"
    passes = calls - repairs
    tokens = _number(perf, "prompt_tokens") + _number(perf, "completion_tokens")
    answered = tokens > 0 or failures > 0
    return {
        "partial": not completed,
        "llm_calls": int(calls),
        "passes": int(passes),
        "first_try_valid": int(passes - first_try_failures),
        "first_try_valid_fraction": _ratio(passes - first_try_failures, passes)
        if answered
        else None,
        "repairs": int(repairs),
        "repaired": int(repaired),
        "repaired_fraction": _ratio(repaired, repairs),
        "repairs_counted_from": source,
        "unusable_answers": int(failures),
        "transport_retries": int(_number(perf, "llm_retries")),
        "splits": int(_number(perf, "splits")),
        "failed_memories": int(_number(perf, "failed")),
        "skipped_memories": int(_number(perf, "skipped")),
        "prompt_tokens": int(_number(perf, "prompt_tokens")),
        "completion_tokens": int(_number(perf, "completion_tokens")),
        "tokens_per_memory": _ratio(tokens, memories),
        "completion_tokens_per_call": _ratio(_number(perf, "completion_tokens"), calls),
        "seconds_per_call": _ratio(_number(perf, "llm_s"), calls),
    }


def log_events(lines: Sequence[bytes]) -> tuple[Counter[str], list[dict[str, Any]]]:
    """Counts of the engine's JSON log events, and the ones worth printing (warnings, splits)."""
    counts: Counter[str] = Counter()
    notable: list[dict[str, Any]] = []
    for line in lines:
        try:
            event = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(event, dict) or not isinstance(event.get("event"), str):
            continue
        counts[event["event"]] += 1
        if event.get("level") in ("warning", "error") or event["event"] in (
            "batch_split",
            "unusable_answer_retry",
        ):
            notable.append(
                {
                    k: event[k]
                    for k in ("event", "level", "reason", "scope", "size", "status", "detail")
                    if k in event
                }
            )
    return counts, notable


# --- judging the observations -----------------------------------------------------------------


@dataclass(frozen=True)
class ObservationSeen:
    scope: tuple[str, ...]
    text: str
    sources: tuple[str, ...]  # memory keys


def _mentions(text: str, words: Sequence[str]) -> bool:
    lowered = text.lower()
    return any(w.lower() in lowered for w in words)


def _placeholder(text: str) -> bool:
    stripped = text.strip().strip("\"'")
    return stripped.lower() in {"", "...", "…", "text"} or sum(c.isalpha() for c in text) < 3


def judge(bank: Bank, observations: Sequence[ObservationSeen]) -> dict[str, Any]:
    """Each label's observations and verdict, and the totals the table prints."""
    label_of = {m.key: m.label for m in bank.memories}
    by_label: dict[str, list[ObservationSeen]] = {name: [] for name in bank.labels}
    mixed = []
    mixed_texts = set()
    for obs in observations:
        labels = sorted({label_of[k] for k in obs.sources if k in label_of})
        for name in labels:
            by_label[name].append(obs)
        if len(labels) > 1:
            mixed.append({"text": obs.text, "labels": labels})
            mixed_texts.add(obs.text)
    verdicts: dict[str, Any] = {}
    totals: Counter[str] = Counter()
    for name, label in bank.labels.items():
        seen = by_label[name]
        problems = []
        if not seen:
            problems.append("no observation cites it")
        tangled = sum(o.text in mixed_texts for o in seen)
        if tangled:
            problems.append(f"{tangled} observation(s) also cite other labels")
        if label.kind == "duplicates":
            totals["duplicates"] += 1
            # One observation, about this label alone: a pile of unrelated facts is no merge.
            totals["duplicates_collapsed"] += len(seen) == 1 and not tangled
            totals["duplicates_extra"] += max(0, len(seen) - 1)
            if len(seen) > 1:
                problems.append(f"{len(seen)} observations (duplicates left)")
        elif label.kind == "state_change":
            totals["state_changes"] += 1
            captured = any(_mentions(o.text, label.current) for o in seen)
            stale = [
                o
                for o in seen
                if _mentions(o.text, label.previous) and not _mentions(o.text, label.current)
            ]
            totals["state_changes_captured"] += captured and not stale
            totals["stale"] += len(stale)
            if seen and not captured:
                problems.append(f"no observation names the new state ({', '.join(label.current)})")
            if stale:
                problems.append(f"{len(stale)} observation(s) still state only the old one")
            if len(seen) > 1:
                problems.append(f"{len(seen)} observations")
        else:
            totals["facts"] += 1
            # Cited by an observation about it alone (a pile of facts may not even say it).
            totals["facts_kept"] += len(seen) > tangled
        verdicts[name] = {
            "kind": label.kind,
            "expect": label.expect,
            "observations": [o.text for o in seen],
            "verdict": "; ".join(problems) or "ok",
        }
    cited = {k for o in observations for k in o.sources}
    return {
        "observations": len(observations),
        "duplicate_labels": totals["duplicates"],
        "duplicate_labels_collapsed": totals["duplicates_collapsed"],
        "duplicate_extra_observations": totals["duplicates_extra"],
        "state_changes": totals["state_changes"],
        "state_changes_captured": totals["state_changes_captured"],
        "stale_observations": totals["stale"],
        "facts": totals["facts"],
        "facts_kept": totals["facts_kept"],
        "observations_mixing_labels": len(mixed),
        "placeholder_observations": sum(_placeholder(o.text) for o in observations),
        "memories_cited": len(cited & set(label_of)),
        "memories": len(bank.memories),
        "mixed": mixed,
        "labels": verdicts,
    }


# --- the table ------------------------------------------------------------------------------


def _fraction(value: float | None, numerator: int, denominator: int) -> str:
    return "n/a" if value is None else f"{value:.2f} ({numerator}/{denominator})"


def render_table(results: Mapping[str, Any]) -> str:
    """The stdout summary of one lane run."""
    server = results["server"]
    op = results["operation"]
    f = results.get("figures") or {}
    j = results.get("judgement") or {}
    model = server.get("model") or {}
    lines = [
        f"real-model lane — {results['machine']['date_utc']}, {results['machine']['nproc']} cores "
        f"({results['machine']['cpu_model']})",
        f"server: {server['kind']} {server.get('version') or ''}".rstrip() + f" at {server['url']}",
        f"model:  {model.get('title') or model.get('name') or server.get('llm_model')}",
        "client: "
        + " ".join(
            f"{k.removeprefix('CONSOLIDATION_')}={v}" for k, v in results["client_env"].items()
        ),
        f"operation {op['status']} in {results['replay_s']:.0f} s"
        + (f" — error: {op['error']}" if op.get("error") else ""),
    ]
    if f:
        lines += [
            "",
            *(
                ["(operation not completed: figures up to its last call)"]
                if f.get("partial")
                else []
            ),
            f"{'LLM calls':<28}{f['llm_calls']}  ({f['passes']} passes, {f['repairs']} repairs)",
            f"{'first-try valid':<28}"
            + _fraction(f["first_try_valid_fraction"], f["first_try_valid"], f["passes"]),
            f"{'repaired':<28}"
            + _fraction(f["repaired_fraction"], f["repaired"], f["repairs"])
            + f"  [counted from {f['repairs_counted_from']}]",
            f"{'transport retries':<28}{f['transport_retries']}",
            f"{'splits':<28}{f['splits']}",
            f"{'failed memories':<28}{f['failed_memories']}",
            f"{'skipped memories':<28}{f['skipped_memories']}",
            f"{'tokens per memory':<28}{f['tokens_per_memory']}  (prompt {f['prompt_tokens']}, "
            f"completion {f['completion_tokens']} in all)",
            f"{'seconds per call':<28}{f['seconds_per_call']}",
            f"{'HTTP statuses (server log)':<28}{server.get('http_statuses') or 'n/a'}",
        ]
    if j:
        lines += [
            "",
            "judged against the bank's labels:",
            f"  {'duplicate labels -> one observation':<40}"
            f"{j['duplicate_labels_collapsed']}/{j['duplicate_labels']}"
            f"  ({j['duplicate_extra_observations']} extra observations)",
            f"  {'state changes captured':<40}{j['state_changes_captured']}/{j['state_changes']}"
            f"  ({j['stale_observations']} stale observations)",
            f"  {'single facts kept':<40}{j['facts_kept']}/{j['facts']}",
            f"  {'observations mixing labels':<40}{j['observations_mixing_labels']}",
            f"  {'placeholder texts':<40}{j['placeholder_observations']}",
            f"  {'memories cited by an observation':<40}{j['memories_cited']}/{j['memories']}",
            "",
            "labels that are not ok:",
        ]
        bad = [(n, v) for n, v in j["labels"].items() if v["verdict"] != "ok"]
        lines += [f"  {n:<14}{v['verdict']}" for n, v in bad] or ["  (none)"]
    observations = results.get("observations") or []
    lines += ["", f"observations ({len(observations)}):"]
    for obs in observations:
        lines.append(f"  [{','.join(obs['scope'])}] {obs['text']}")
        lines.append(f"      <- {', '.join(obs['sources']) or '(no source)'}")
    return "\n".join(lines)
