"""What a call to one actor came to, read from the exception it raised: one reading
(orchestrator/fleet/outcomes.py: outcome_of) for every caller in the fleet and the control, checked
on Ray's own exception classes, without Ray running."""
import ast
import os

import ray.exceptions as rx

from orchestrator.fleet.outcomes import DIED, HUNG, RAISED, outcome_of, replica_failure

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_an_actor_unreachable_is_taken_for_gone_everywhere():
    """ActorUnavailableError (a RayActorError): its node is unreachable (removed, cut off) or it
    is restarting. Ray does not say when it comes back, and the call may or may not have run: it
    reads died for every caller (before, the shards' and the server's reading said hung and the
    replicas' said died)."""
    exc = rx.ActorUnavailableError("its node is unreachable", None)
    out = outcome_of(exc)
    assert out.status == DIED and "ActorUnavailableError" in out.detail and out.actor_error
    failure = replica_failure(2, exc, replacement=True)
    assert (failure.rank, failure.cause, failure.replacement) == (2, "died", True)
    assert "unreachable" in failure.detail


def test_a_dead_actor_or_a_lost_answer_is_died():
    for exc in (rx.ActorDiedError(), rx.RayActorError(), rx.ObjectLostError("ab" * 20, None, ""),
                rx.OwnerDiedError("ab" * 20, None, "")):
        out = outcome_of(exc)
        assert out.status == DIED and out.actor_error and out.detail.startswith(type(exc).__name__), exc
        assert replica_failure(0, exc).cause == "died"


def test_a_call_that_raised_is_raised_and_one_not_answered_in_time_is_hung():
    raised = rx.RayTaskError("step", "Traceback ...\nValueError: bad batch", ValueError("bad batch"))
    out = outcome_of(raised.as_instanceof_cause())
    assert out.status == RAISED and out.detail == "bad batch" and not out.actor_error
    failure = replica_failure(1, raised.as_instanceof_cause())
    assert failure.cause == "error" and failure.detail == "ValueError: bad batch" and "bad batch" in failure.traceback
    # an actor's death joined to a task error reads as that death (ReplicaGroup then asks the
    # actor whether the dead one is it or an input's maker)
    dual = rx.RayTaskError("step", "tb", rx.ActorDiedError()).as_instanceof_cause()
    assert isinstance(dual, rx.RayActorError)
    assert outcome_of(dual).status == DIED and outcome_of(dual).actor_error
    assert outcome_of(rx.GetTimeoutError("no answer within 5s")).status == HUNG
    assert not outcome_of(rx.GetTimeoutError("no answer within 5s")).actor_error


ACTOR_ERRORS = {"RayActorError", "ActorDiedError", "ActorUnavailableError", "ObjectLostError", "OwnerDiedError"}
READERS = {"outcome_of", "replica_failure"}  # orchestrator/fleet/outcomes.py's readings of an exception


def own_readings(source: str) -> list[int]:
    """The lines of `except` clauses that catch a Ray actor error and read it on their own: the
    exception caught is not handed to outcome_of or replica_failure in the clause's body."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ExceptHandler) or node.type is None:
            continue
        caught = {n.id for n in ast.walk(node.type) if isinstance(n, ast.Name)} | \
                 {n.attr for n in ast.walk(node.type) if isinstance(n, ast.Attribute)}
        if not caught & ACTOR_ERRORS:
            continue
        handed = node.name is not None and any(
            isinstance(call, ast.Call)
            and (getattr(call.func, "id", None) in READERS or getattr(call.func, "attr", None) in READERS)
            and any(isinstance(a, ast.Name) and a.id == node.name for a in call.args)
            for stmt in node.body for call in ast.walk(stmt))
        if not handed:
            lines.append(node.lineno)
    return lines


def test_the_finder_sees_a_clause_that_reads_an_actor_error_on_its_own():
    alone = "try:\n    f()\nexcept ray.exceptions.RayActorError:\n    died()\n"
    handed = "try:\n    f()\nexcept (RayActorError, ObjectLostError) as exc:\n    fail(replica_failure(r, exc))\n"
    other = "try:\n    f()\nexcept ValueError:\n    pass\n"
    assert own_readings(alone) == [3] and own_readings(handed) == [] and own_readings(other) == []


def test_every_call_to_an_actor_in_the_fleet_and_the_control_is_read_by_outcome_of():
    """No module of orchestrator/fleet or orchestrator/control reads a Ray actor error on its own
    (died, hung or raised: outcome_of says which). persistence's checkpoint keeper is not judged:
    any actor error there starts a new keeper; actors/ cannot import orchestrator/."""
    found = []
    for package in ("orchestrator/fleet", "orchestrator/control"):
        for folder, _, files in os.walk(os.path.join(REPO, package)):
            for f in files:
                path = os.path.join(folder, f)
                if not f.endswith(".py") or path.endswith(os.path.join("fleet", "outcomes.py")):
                    continue
                with open(path, encoding="utf-8") as fh:
                    found += [f"{os.path.relpath(path, REPO)}:{line}" for line in own_readings(fh.read())]
    assert found == []
