"""Answer one pass with contract v2: candidates, decide calls, rewrite calls, assembly.

Takes what a v1 pass takes (its :class:`~consolidation.llm.prompts.PassRequest`) and returns what a
v1 answer gives (a :class:`~consolidation.llm.prompts.PassPlan`), so everything after the answer is
the engine's as for v1. Facts without a candidate make no call. Without ``complete`` (the
offline consolidator) the decisions and rewrites are made locally, with no call at all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import orjson
import structlog

from consolidation.errors import InvalidLLMOutput
from consolidation.llm import narrow
from consolidation.llm.client import LLMAnswer
from consolidation.llm.prompts import Chat, PassPlan, PassRequest
from consolidation.llm.prompts_v2 import (
    NEW,
    Decision,
    Question,
    Shown,
    confirm_chat,
    decide_chat,
    parse_confirm,
    parse_decisions,
    parse_rewrite,
    rewrite_chat,
)

log = structlog.get_logger("consolidation.llm")

Complete = Callable[[Chat], Awaitable[LLMAnswer]]
Embed = Callable[[Sequence[str]], Awaitable[Sequence[str | None]]]


async def answer_pass(
    request: PassRequest,
    complete: Complete | None,
    embed: Embed | None,
    options: narrow.NarrowOptions,
) -> PassPlan:
    """The plan of one pass. Raises InvalidLLMOutput when a decide answer stays unusable after
    one repair (the engine retries the pass, then splits it); a rewrite never fails the pass: it
    falls back to :func:`consolidation.llm.narrow.join`."""
    inputs = narrow.pass_inputs(request)
    vectors = None
    if embed is not None:
        texts = narrow.embedded_texts(inputs, by_sentence=complete is None)
        embedded = await embed(texts)
        vectors = {
            text: orjson.loads(vector)
            for text, vector in zip(texts, embedded, strict=True)
            if vector is not None
        }
    found = narrow.pick_candidates(inputs, vectors, options, by_sentence=complete is None)
    if complete is None:
        decisions = narrow.local_decisions(found, options)
        _log_decisions(found, decisions, local=True)
    else:
        decisions = await _decisions(complete, inputs, found, options)
    stale = narrow.made_stale(found, decisions)
    if complete is not None and stale:
        stale = await _confirmed_stale(complete, inputs, found, stale)
    if stale:
        _log_stale(found, decisions, stale)
    bridges = narrow.bridged(found, decisions, stale, options)
    if bridges:
        bridges = await _confirmed_bridges(complete, inputs, found, decisions, bridges, options)
    if bridges:
        _log_bridges(found, decisions, bridges)
    absorbed = {ref: [*stale.get(ref, ()), *bridges.get(ref, ())] for ref in {*stale, *bridges}}
    groups = narrow.assemble(inputs, decisions, absorbed)
    wanted = [(i, g) for i, g in enumerate(groups) if g.updating]
    if complete is None:
        texts_of = [narrow.join(g.base, [f.shown() for f in g.updating]) for _, g in wanted]
    else:
        texts_of = await asyncio.gather(
            *(
                _rewrite(
                    complete,
                    inputs,
                    g.base,
                    [f.shown() for f in g.updating],
                    old_is_fact=g.observation is None,
                )
                for _, g in wanted
            )
        )
    return narrow.to_plan(
        inputs, groups, {i: text for (i, _), text in zip(wanted, texts_of, strict=True)}
    )


async def _decisions(
    complete: Complete,
    inputs: narrow.PassInputs,
    found: narrow.Candidates,
    options: narrow.NarrowOptions,
) -> dict[str, Decision]:
    """Every fact's decision: the sure ones without a call, the rest asked; a same/update moved
    to the candidate that shares clearly more with the fact, or to the one that states the value
    its change replaces when the pick does not (:func:`narrow.onto_old_value`), and one whose
    candidate shares too little moved to the one candidate that shares enough or made new when
    it shares nothing; then new if its candidate measures another property of the subject, or
    else, when it shares too little (or less than half of what the fact names), confirmed by a
    yes/no question. A fact with one candidate whose pick would only be made new or asked about
    skips the decide call (:func:`narrow.without_decide`)."""
    sure = narrow.sure_decisions(found, options)
    unsure = [q for q in found.questions if q.fact.ref not in sure]
    settled, measuring, direct = narrow.without_decide(found, unsure)
    asked = [q for q in unsure if q.fact.ref not in settled and q.fact.ref not in direct]
    size = options.facts_per_call
    chunks = [asked[i : i + size] for i in range(0, len(asked), size)]
    answers = await asyncio.gather(*(_decide(complete, inputs, chunk) for chunk in chunks))
    model_said = {ref: d for answer in answers for ref, d in answer.items()}
    said = {
        ref: narrow.onto_old_value(found, ref, narrow.clearer(found, ref, d))
        for ref, d in model_said.items()
    }
    doubtful = []
    for ref in narrow.unlinked(found, said):
        better = narrow.stronger(found, ref, said[ref])
        if better is None:
            doubtful.append(ref)
        else:
            said[ref] = better
    # None of these is doubtful already: a doubtful pick shares fewer than two telling words.
    doubtful.extend(narrow.thin(found, said))
    apart = narrow.apart(found, said)
    said.update((ref, Decision(NEW)) for ref in apart)
    doubtful = [ref for ref in doubtful if ref not in apart]
    said.update((ref, narrow.confirmed_pick(found, ref)) for ref in direct)
    doubtful.extend(direct)
    confirmed = await asyncio.gather(
        *(_confirm(complete, inputs, found, ref, said[ref].target) for ref in doubtful)
    )
    for ref, yes in zip(doubtful, confirmed, strict=True):
        if not yes:
            said[ref] = Decision(NEW)
    said.update(settled)
    decisions = narrow.checked_decisions(found, {**said, **sure})
    _log_decisions(
        found,
        decisions,
        sure=sure,
        doubtful=doubtful,
        apart=[*apart, *measuring],
        unasked=[ref for ref in settled if ref not in measuring],
        model=model_said,
    )
    return decisions


def _log_decisions(
    found: narrow.Candidates,
    decisions: Mapping[str, Decision],
    *,
    sure: Mapping[str, Decision] | None = None,
    doubtful: Sequence[str] = (),
    apart: Sequence[str] = (),
    unasked: Sequence[str] = (),
    model: Mapping[str, Decision] | None = None,
    local: bool = False,
) -> None:
    """The ``v2_decisions`` debug log of a pass: each fact as :func:`_explained` tells it."""
    if log.is_enabled_for(logging.DEBUG):  # the entries cost more than the check
        explain = functools.partial(
            _explained,
            sure=sure,
            doubtful=doubtful,
            apart=apart,
            unasked=unasked,
            model=model,
            local=local,
        )
        entries = [explain(q, decisions[q.fact.ref]) for q in found.questions]
        log.debug("v2_decisions", decisions=entries)


def _explained(
    question: Question,
    decision: Decision,
    *,
    sure: Mapping[str, Decision] | None = None,
    doubtful: Sequence[str] = (),
    apart: Sequence[str] = (),
    unasked: Sequence[str] = (),
    model: Mapping[str, Decision] | None = None,
    local: bool = False,
) -> dict[str, Any]:
    """One fact of the ``v2_decisions`` log: its candidates, what was applied, and how."""
    ref = question.fact.ref
    said = (model or {}).get(ref)
    if local:
        via = "local"  # the offline consolidator: no model was asked
    elif ref in (sure or {}):
        via = "sure"
    elif ref in doubtful:
        via = "confirmed"
    elif ref in apart:
        via = "apart"  # the candidate (the model picked) measures something else of the subject
    elif ref in unasked or (said is not None and said.kind != NEW and decision.kind == NEW):
        via = "unlinked"  # it shares no telling word with the candidate (the model picked)
    elif said is not None and said.target != decision.target:
        via = "retargeted"  # the kind may differ too: checked_decisions turns a same into an update
    else:
        via = "model"
    return {
        "fact": question.fact.text,
        "candidates": [c.text for c in question.candidates],
        "decision": decision.kind,
        "target": narrow.candidate_text(question, decision.target),
        "via": via,
        "model_said": None
        if said is None
        else f"{said.kind} {narrow.candidate_text(question, said.target) or ''}".strip(),
    }


async def _confirmed_stale(
    complete: Complete,
    inputs: narrow.PassInputs,
    found: narrow.Candidates,
    stale: Mapping[str, Sequence[str]],
) -> dict[str, list[str]]:
    """The observations of ``stale`` the yes/no question, asked as of a change, says each
    fact's change leaves holding an old value."""
    asked = [(ref, target) for ref, targets in stale.items() for target in targets]
    said = await asyncio.gather(
        *(_confirm(complete, inputs, found, ref, target, of_change=True) for ref, target in asked)
    )
    return _said_yes(asked, said)


async def _confirmed_bridges(
    complete: Complete | None,
    inputs: narrow.PassInputs,
    found: narrow.Candidates,
    decisions: Mapping[str, Decision],
    bridges: Mapping[str, Sequence[str]],
    options: narrow.NarrowOptions,
) -> dict[str, list[str]]:
    """The observations of ``bridges`` that are one with the observation each fact joins.

    With a model, two yes/no questions must say yes: the fact's of the other observation, then
    the other's of the joined one. Each alone says yes where the two are aspects of one project
    ("The Atlas code lives in the internal GitLab" of "The Atlas backend is written in Go", or
    "Maria leads design work on the Atlas backend, budget planning and Tuesday meetings" of the
    budget), and the 1.5B model says no to one of the two there (docs/quality.md, "Two
    observations a fact bridges"). Without a model, the other must be linked to the fact as the
    offline consolidator links what it joins (:func:`narrow.locally_linked`)."""
    asked = [(ref, target) for ref, targets in bridges.items() for target in targets]
    if complete is None:
        said = [narrow.locally_linked(found, ref, target, options) for ref, target in asked]
    else:
        said = await asyncio.gather(
            *(
                _bridge(complete, inputs, found, decisions[ref], ref, target)
                for ref, target in asked
            )
        )
    return _said_yes(asked, said)


def _said_yes(asked: Sequence[tuple[str, str]], said: Sequence[bool]) -> dict[str, list[str]]:
    """The targets of ``asked`` (fact ref, observation ref) whose answer in ``said`` is yes,
    by fact."""
    confirmed: dict[str, list[str]] = {}
    for (ref, target), yes in zip(asked, said, strict=True):
        if yes:
            confirmed.setdefault(ref, []).append(target)
    return confirmed


async def _bridge(
    complete: Complete,
    inputs: narrow.PassInputs,
    found: narrow.Candidates,
    decision: Decision,
    ref: str,
    other: str,
) -> bool:
    """Whether fact ``ref`` restates observation ``other`` and ``other`` is the same thing as
    the observation the fact joins (``decision``'s): the second is asked only after a yes."""
    if not await _confirm(complete, inputs, found, ref, other):
        return False
    joined = inputs.item(decision.target or "").shown()
    return await _confirm_pair(complete, inputs, inputs.item(other).shown(), joined)


def _log_bridges(
    found: narrow.Candidates,
    decisions: Mapping[str, Decision],
    bridges: Mapping[str, Sequence[str]],
) -> None:
    """The ``v2_bridges`` debug log: each fact, the text it joins and those merged into it."""
    _log_folded("v2_bridges", "bridges", ("joins", "merges"), found, decisions, bridges)


def _log_stale(
    found: narrow.Candidates,
    decisions: Mapping[str, Decision],
    stale: Mapping[str, Sequence[str]],
) -> None:
    """The ``v2_stale`` debug log: each change, what it updates and what it ends beside."""
    _log_folded("v2_stale", "changes", ("updates", "ends"), found, decisions, stale)


def _log_folded(
    event: str,
    field: str,
    keys: tuple[str, str],
    found: narrow.Candidates,
    decisions: Mapping[str, Decision],
    folded: Mapping[str, Sequence[str]],
) -> None:
    """A debug log of facts whose group takes other observations: each fact's text, the text
    of the observation it targets (``keys[0]``) and those folded in beside it (``keys[1]``)."""
    if log.is_enabled_for(logging.DEBUG):
        entries = []
        for ref, targets in folded.items():
            question = found.question(ref)
            entries.append(
                {
                    "fact": question.fact.text,
                    keys[0]: narrow.candidate_text(question, decisions[ref].target),
                    keys[1]: [narrow.candidate_text(question, target) for target in targets],
                }
            )
        log.debug(event, **{field: entries})


async def _confirm(
    complete: Complete,
    inputs: narrow.PassInputs,
    found: narrow.Candidates,
    ref: str,
    target: str | None,
    *,
    of_change: bool = False,
) -> bool:
    """The yes/no question of fact ``ref`` and its candidate ``target``."""
    question = found.question(ref)
    candidate = next(c for c in question.candidates if c.ref == target)
    return await _confirm_pair(complete, inputs, question.fact, candidate, of_change=of_change)


async def _confirm_pair(
    complete: Complete,
    inputs: narrow.PassInputs,
    fact: Shown,
    observation: Shown,
    *,
    of_change: bool = False,
) -> bool:
    """The yes/no question of ``fact`` and ``observation``: True only for a usable yes."""
    chat = confirm_chat(
        inputs.bank, inputs.scope, inputs.mission, fact, observation, of_change=of_change
    )
    try:
        return parse_confirm((await complete(chat)).content)
    except InvalidLLMOutput:
        return False  # no usable yes: the fact stays apart, which loses nothing


def _numbered(questions: Sequence[Question]) -> tuple[list[Question], dict[str, str]]:
    """``questions`` with the observations they show numbered ``o1``, ``o2``, ... in the order
    shown, and the pass's ref each number stands for. A pass numbers observations in the order
    it recalled them, which is not the same from one run of a bank to the next (ties go by
    random ids); numbered by the request, a decide request says the same whatever that order,
    and a small model's pick does not turn with a ref."""
    numbers: dict[str, str] = {}
    for question in questions:
        for candidate in question.candidates:
            if candidate.ref.startswith("o") and candidate.ref not in numbers:
                numbers[candidate.ref] = f"o{len(numbers) + 1}"
    numbered = [
        Question(
            q.fact,
            tuple(dataclasses.replace(c, ref=numbers.get(c.ref, c.ref)) for c in q.candidates),
        )
        for q in questions
    ]
    return numbered, {number: ref for ref, number in numbers.items()}


async def _decide(
    complete: Complete, inputs: narrow.PassInputs, questions: Sequence[Question]
) -> dict[str, Decision]:
    numbered, refs = _numbered(questions)
    chat = decide_chat(inputs.bank, inputs.scope, inputs.mission, numbered)
    try:
        said = parse_decisions((await complete(chat)).content, numbered)
    except InvalidLLMOutput as exc:
        # Schema-pinned servers rarely get here; a JSON-mode-only one may.
        repaired = _with_problems(chat, exc.answer or "", exc.problems or [str(exc)])
        said = parse_decisions((await complete(repaired)).content, numbered)
    return {
        ref: Decision(d.kind, refs.get(d.target, d.target) if d.target else d.target)
        for ref, d in said.items()
    }


async def _rewrite(
    complete: Complete,
    inputs: narrow.PassInputs,
    old: Shown,
    facts: Sequence[Shown],
    *,
    old_is_fact: bool,
) -> str:
    """The model's rewrite if it passes the guards (at most one repair), else the join."""
    chat = rewrite_chat(inputs.bank, inputs.scope, inputs.mission, old, facts)
    for attempt in (1, 2):
        try:
            answer = await complete(chat)
            text = parse_rewrite(answer.content)
        except InvalidLLMOutput as exc:
            problems, content = exc.problems or [str(exc)], exc.answer or ""
        else:
            problems, content = (
                narrow.rewrite_problems(old, facts, text, old_is_fact=old_is_fact),
                answer.content,
            )
            if not problems:
                return text
        if attempt == 1:
            chat = _with_problems(chat, content, problems)
    return narrow.join(old, facts)


def _with_problems(chat: Chat, answer: str, problems: Sequence[str]) -> Chat:
    note = (
        "That answer cannot be used:\n"
        + "".join(f"- {problem}\n" for problem in problems)
        + "Answer again with one corrected JSON object in the same format."
    )
    return dataclasses.replace(chat, turns=(("assistant", answer or "{}"), ("user", note)))
