"""Run one operation: waves, groups, batches, passes, markers, final status.

The only package that knows the whole flow (DESIGN §2). ``replay`` and the worker both call
:func:`run_operation`, so the foreground and the service run the identical engine. One job a
module, in the order of a run: ``attempt`` (lease, run kinds, recording the end), ``outcome``
(the end policy, pure), ``stop`` (stop signal and checks), ``budget`` (the bank's token budget
as a run sees it), ``consolidate`` (the parts put
together), ``waves`` (pipeline and closer), ``slots`` and ``openings`` (who runs next),
``group`` (a group's passes, split-on-failure), ``passes`` (one pass), ``recall`` (where a
pass's recall comes from), ``asker`` (asking the model, the vectors), ``plan`` (pure planning),
``forget`` (the forget operation).
"""

from consolidation.engine.attempt import RUN_KINDS, LeaseKeeper, OperationEnd, run_operation
from consolidation.engine.outcome import MAX_INTERRUPTIONS, EndDecision, EndKind, decide_end
from consolidation.engine.stop import StopReason, StopSignal
from consolidation.engine.summary import ProgressCallback, RunSummary
from consolidation.engine.waves import MAX_WAVES_IN_FLIGHT

__all__ = [
    "MAX_INTERRUPTIONS",
    "MAX_WAVES_IN_FLIGHT",
    "RUN_KINDS",
    "EndDecision",
    "EndKind",
    "LeaseKeeper",
    "OperationEnd",
    "ProgressCallback",
    "RunSummary",
    "StopReason",
    "StopSignal",
    "decide_end",
    "run_operation",
]
