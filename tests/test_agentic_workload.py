"""benchmarks/agentic_workload.py without a vLLM: the sessions' prompts (byte-identical for every peer, forked
from one shared context, tool outputs appended), their times, and the order `run_session` sends them in."""

from __future__ import annotations

import random
import statistics
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from agentic_workload import AgenticShape, SessionTimes, Step, build_sessions, run_session, session_times  # noqa: E402
from multi_round_qa import parse_args  # noqa: E402
from serving import working_set_tokens  # noqa: E402

SHAPE = AgenticShape(sessions=2, subagents=3, turns=3, system=16, context=40, question=30, tool_output=24, answer=4)
CORPUS = list(range(1000, 1500))


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def is_prefix(a: list[int], b: list[int]) -> bool:
    return b[:len(a)] == a


def test_sessions_fork_from_one_context_and_append_tool_outputs() -> None:
    sessions = build_sessions(SHAPE, CORPUS, encode, 1, count=2)
    assert sessions == build_sessions(SHAPE, CORPUS, encode, 1, count=2)  # every peer gets the same tokens
    first, second = sessions
    system = first.plan[:1 + SHAPE.system]
    assert second.plan[:len(system)] == system and first.plan[0] == 1  # the tools' prompt is every session's
    assert first.plan[len(system):] != second.plan[len(system):]  # contexts and tasks are the session's own
    assert len(first.plan) == 1 + SHAPE.system + SHAPE.context + SHAPE.question
    forked = first.plan + first.subagents[0][0][len(first.plan):len(first.plan) + SHAPE.answer]
    for turns in first.subagents:
        assert len(turns) == SHAPE.turns and is_prefix(forked, turns[0])  # every sub-agent forks from the plan
        for before, after in zip(turns, turns[1:]):  # each turn extends the last by an answer and a tool output
            assert is_prefix(before, after) and len(after) == len(before) + SHAPE.answer + SHAPE.tool_output
    instructions = {tuple(turns[0][len(forked):]) for turns in first.subagents}
    assert len(instructions) == SHAPE.subagents  # each sub-agent has its own instruction
    assert is_prefix(forked, first.merge)
    assert len(first.merge) == len(forked) + SHAPE.subagents * SHAPE.tool_output
    assert len(first.prompts()) == 1 + SHAPE.subagents * SHAPE.turns + 1
    # the prefix tree of a session's leaves counts the shared context once
    ends = first.ends()
    tree = working_set_tokens([ends], SHAPE.answer)
    assert len(forked) < tree < sum(len(e) + SHAPE.answer for e in ends)


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="every size must be >= 1"):
        build_sessions(AgenticShape(1, 0, 1, 1, 1, 1, 1, 1), CORPUS, encode, None, count=1)
    with pytest.raises(ValueError, match="empty corpus"):
        build_sessions(SHAPE, [], encode, None, count=1)


def test_times_are_the_same_for_every_peer_and_have_the_asked_rate() -> None:
    shape = AgenticShape(400, 3, 3, 1, 1, 1, 1, 1)
    times = session_times(shape, 400, 2.0, 1.5, "poisson", random.Random(0))
    assert times == session_times(shape, 400, 2.0, 1.5, "poisson", random.Random(0))
    starts = [t.start for t in times]
    assert starts[0] == 0.0 and starts == sorted(starts)
    assert statistics.mean(b - a for a, b in zip(starts, starts[1:])) == pytest.approx(0.5, rel=0.15)
    thinks = [x for t in times for per_agent in t.thinks for x in per_agent]
    assert len(times[0].thinks) == 3 and all(len(per_agent) == 2 for per_agent in times[0].thinks)
    assert statistics.mean(thinks) == pytest.approx(1.5, rel=0.1)
    uniform = session_times(AgenticShape(3, 2, 2, 1, 1, 1, 1, 1), 3, 4.0, 0.25, "uniform", random.Random(1))
    assert [t.start for t in uniform] == [0.0, 0.25, 0.5] and uniform[0].thinks == [[0.25], [0.25]]
    with pytest.raises(ValueError, match="session rate must be > 0"):
        session_times(shape, 1, 0.0, 1.0, "poisson", random.Random(0))
    with pytest.raises(ValueError, match="think time must be >= 0"):
        session_times(shape, 1, 1.0, -1.0, "poisson", random.Random(0))


def test_a_session_plans_then_runs_its_subagents_side_by_side_then_merges() -> None:
    session = build_sessions(SHAPE, CORPUS, encode, None, count=1)[0]
    sent: list[Step] = []
    lock = threading.Lock()
    both_running = threading.Barrier(SHAPE.subagents, timeout=60)  # every sub-agent's first turn in flight at once

    def send(step: Step) -> bool:
        if step.role == "subagent" and step.turn == 1:
            both_running.wait()
        with lock:
            sent.append(step)
        return True

    run_session(session, 0, SessionTimes(0.0, [[0.0] * (SHAPE.turns - 1)] * SHAPE.subagents), time.perf_counter(),
                send)
    assert [s.role for s in sent][0] == "plan" and sent[-1].role == "merge" and sent[-1].prompt == session.merge
    middle = sent[1:-1]
    assert len(middle) == SHAPE.subagents * SHAPE.turns and {s.role for s in middle} == {"subagent"}
    for k in range(SHAPE.subagents):  # each sub-agent's turns in order, each the prompt built for it
        mine = [s for s in middle if s.subagent == k]
        assert [s.turn for s in mine] == [1, 2, 3] and [s.prompt for s in mine] == session.subagents[k]


def test_a_failed_turn_ends_its_subagent_and_the_merge_still_runs() -> None:
    session = build_sessions(SHAPE, CORPUS, encode, None, count=1)[0]
    sent: list[Step] = []
    lock = threading.Lock()

    def send(step: Step) -> bool:
        with lock:
            sent.append(step)
        return not (step.subagent == 1 and step.turn == 2)

    run_session(session, 0, SessionTimes(0.0, [[0.0] * (SHAPE.turns - 1)] * SHAPE.subagents), time.perf_counter(),
                send)
    assert [s.turn for s in sent if s.subagent == 1] == [1, 2]  # its third turn is never sent
    assert len([s for s in sent if s.subagent == 0]) == SHAPE.turns and sent[-1].role == "merge"
    failed_plan: list[Step] = []
    run_session(session, 0, SessionTimes(0.0, [[0.0] * 2] * 3), time.perf_counter(),
                lambda step: failed_plan.append(step) is not None)  # the plan fails: nothing else is sent
    assert [s.role for s in failed_plan] == ["plan"]


def test_the_agentic_flags_rates_and_quick_sizes() -> None:
    args = parse_args(["--workload", "agentic"])
    assert args.qps == [0.125, 0.25, 0.5, 1.0] and args.sessions == 4 and args.think_secs == 1.0
    quick = parse_args(["--workload", "agentic", "--quick", "--turns", "4"])
    assert quick.qps == [0.25, 0.5] and quick.subagents == 2 and quick.turns == 4  # a given size wins
    assert parse_args(["--quick"]).qps == [1.0, 2.0]  # the qa workload keeps its own
    for bad in (["--workload", "agentic", "--soak", "60"], ["--think-secs", "-1"], ["--subagents", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
