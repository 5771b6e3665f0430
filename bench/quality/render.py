"""The stdout table of a quality run: per bank, the run beside the trivial baselines. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bench.perf import tokens
from bench.quality.judge import shortfalls

_COLUMNS = (
    ("dups", 7),
    ("states", 7),
    ("stale", 6),
    ("singles", 8),
    ("mixing", 7),
    ("hardneg", 8),
    ("unsupp", 7),
    ("skipped", 8),
    ("obs/perfect", 12),
    ("calls", 6),
    ("valid", 6),
    ("tok/mem", 8),
    ("s", 6),
)


def _cells(j: Mapping[str, Any], figures: Mapping[str, Any] | None, seconds: Any) -> list[str]:
    f = figures or {}
    valid = f.get("first_try_valid_fraction")
    return [
        f"{j['duplicate_labels_collapsed']}/{j['duplicate_labels']}",
        f"{j['state_changes_captured']}/{j['state_changes']}",
        str(j["stale_observations"]),
        f"{j['facts_kept']}/{j['facts']}",
        str(j["observations_mixing_labels"]),
        f"{j['hard_negatives_merged']}/{j['hard_negative_pairs']}",
        str(j["unsupported_observations"]),
        str(j["skipped_memories"] + j["failed_memories"] + j["unconsolidated_memories"]),
        f"{j['observations']}/{j['perfect_observations']}",
        "-" if not f else str(f.get("llm_calls")),
        "-" if valid is None else f"{valid:.2f}",
        "-" if f.get("tokens_per_memory") is None else f"{f['tokens_per_memory']:.0f}",
        "-" if seconds is None else f"{seconds:.0f}",
    ]


def _row(name: str, cells: list[str]) -> str:
    return f"  {name:<16}" + "".join(f"{c:>{w}}" for c, (_, w) in zip(cells, _COLUMNS, strict=True))


def render(results: Mapping[str, Any]) -> str:
    """Per bank: the run, then ``one per memory`` and ``one per scope``; then what fell short."""
    server = results["server"]
    mode = results["mode"]
    title = {
        "oracle": "oracle (contract "
        + results["client_env"].get("CONSOLIDATION_LLM_CONTRACT", "default")
        + ")",
        "offline": "offline consolidator",
    }.get(mode, str(server.get("llm_model")))
    lines = [
        f"bench quality — {title}, {results['machine']['date_utc']}, "
        f"{results['machine']['nproc']} cores",
        "client: "
        + " ".join(
            f"{k.removeprefix('CONSOLIDATION_')}={v}"
            for k, v in results["client_env"].items()
            if not k.endswith(("_BASE_URL", "_MODEL"))
        ),
        "dups: duplicate groups as exactly one observation; states: state changes whose newest "
        "state is named, with no stale-only observation; singles: single facts with an "
        "observation of their own; mixing: observations citing several labels; hardneg: hard-"
        "negative pairs merged; unsupp: observations with content words found in no source; "
        "skipped: memories skipped, failed or left pending; valid: first-try valid answers",
    ]
    for name, b in results["banks"].items():
        j = b["judgement"]
        op = b.get("operation") or {}
        lines += [
            "",
            f"{name}{' (held out)' if b['held_out'] else ''}: {b['memories']} memories, "
            f"{b['labels']} labels — operation {op.get('status')}"
            + (f" ({op['error']})" if op.get("error") else ""),
            "  " + " " * 16 + "".join(f"{h:>{w}}" for h, w in _COLUMNS),
            _row(mode, _cells(j, b.get("figures"), b.get("replay_s"))),
        ]
        for baseline, bj in b["baselines"].items():
            lines.append(_row(baseline, _cells(bj, None, None)))
        if b.get("tokens"):
            lines.append("  " + tokens.render("tokens", b["tokens"]))
        short = shortfalls(j)
        if mode == "oracle" and short:
            lines.append("  the pipeline falls short of the oracle: " + "; ".join(short))
        bad = [(n, v) for n, v in j["labels"].items() if v["verdict"] != "ok"]
        for n, v in bad:
            lines.append(f"    {n:<18}{v['verdict']}")
        for item in j["hard_negatives_merged_detail"]:
            lines.append(f"    hard negatives {' + '.join(item['labels'])} in: {item['text']}")
        for item in j["unsupported"]:
            lines.append(f"    unsupported {', '.join(item['words'])} in: {item['text']}")
        for kind in ("skipped", "failed", "unconsolidated"):
            for item in j[kind]:
                reason = item.get("reason") or ""
                lines.append(f"    {kind} {item['key']}" + (f": {reason}" if reason else ""))
    return "\n".join(lines)


def render_markdown(results: Mapping[str, Any]) -> str:
    """One markdown table of a run: a row per bank, the run's figures (for docs/quality.md)."""
    head = ["bank", *(h for h, _ in _COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for bank, b in results["banks"].items():
        cells = _cells(b["judgement"], b.get("figures"), b.get("replay_s"))
        label = f"{bank}{' (held out)' if b['held_out'] else ''}"
        lines.append("| " + " | ".join([label, *cells]) + " |")
    return "\n".join(lines)


def render_baselines_markdown(results: Mapping[str, Any]) -> str:
    """The trivial baselines of every bank, as one markdown table."""
    head = ["bank", "baseline", *(h for h, _ in _COLUMNS[:9])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for bank, b in results["banks"].items():
        for baseline, j in b["baselines"].items():
            cells = _cells(j, None, None)[:9]
            lines.append("| " + " | ".join([bank, baseline, *cells]) + " |")
    return "\n".join(lines)
