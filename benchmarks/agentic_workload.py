"""The agentic workload of `benchmarks/multi_round_qa.py --workload agentic`: agent sessions that fork sub-agents
from a long shared context, append tool outputs turn by turn, think between turns, and merge the results.

One session (all pieces cut from the corpus behind tags, `serving.Pieces`, so every peer gets byte-identical
prompts; answers in the history are fixed stand-ins of --answer tokens, as in the QA workload):

  plan      system + the session's context + its task                      -> the plan (an answer)
  fork      each of --subagents sub-agents: plan prompt + plan + its own instruction, then --turns turns, each
            the previous prompt + its answer + a tool output of --tool-output tokens, sent after a think time
            (the tool running: exponential, mean --think-secs, or exactly that with --arrivals uniform)
  merge     plan prompt + plan + each sub-agent's result (a tool-output-sized piece per sub-agent) -> the answer

The system prompt is shared by every session (the tool definitions); the context (--context tokens: the files,
the repository) is the session's own and shared by its plan, its sub-agents and its merge. Sub-agents run side by
side once the plan has answered; the merge waits for all of them. Sessions start at the level's rate (sessions
per second: a Poisson process, or evenly with --arrivals uniform). Reuse comes from the fork (every sub-agent
shares the plan's prefix), the turns (each extends its last prompt) and the merge; between two turns of one
sub-agent the other sessions' prompts go through vLLM's KV space.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Callable

from serving import Pieces  # benchmarks/serving.py, beside this file


@dataclass(frozen=True)
class AgenticShape:
    sessions: int  # per level
    subagents: int  # per session
    turns: int  # requests per sub-agent
    system: int  # shared system prompt (the tools), tokens
    context: int  # each session's own context, tokens
    question: int  # the task and each sub-agent's instruction, tokens
    tool_output: int  # each tool output appended to a sub-agent's history, and each merged result, tokens
    answer: int  # generated tokens per request (and the stand-in answer in a history)


@dataclass
class Session:
    """One session's prompts: the plan, the sub-agents' turns (subagents[k][t]) and the merge."""

    plan: list[int]
    subagents: list[list[list[int]]]
    merge: list[int]

    def prompts(self) -> list[list[int]]:
        return [self.plan, *(p for turns in self.subagents for p in turns), self.merge]

    def ends(self) -> list[list[int]]:
        """The prompts no other prompt of the session extends (the leaves of its prefix tree)."""
        return [turns[-1] for turns in self.subagents] + [self.merge]


def build_sessions(shape: AgenticShape, corpus: list[int], encode: Callable[[str], list[int]], bos: int | None,
                   count: int) -> list[Session]:
    """`count` sessions of `shape` (the same arguments give the same tokens)."""
    sizes = (shape.subagents, shape.turns, shape.context, shape.question, shape.tool_output, shape.answer)
    if min(sizes) < 1 or shape.system < 0 or count < 0:
        raise ValueError(f"every size must be >= 1 (system >= 0): {shape}")
    piece = Pieces(corpus, encode)
    system = ([] if bos is None else [bos]) + piece("[tools] ", shape.system)
    answer = piece("[answer] ", shape.answer)
    sessions = []
    for s in range(count):
        plan = system + piece(f"[context of session {s}] ", shape.context) + piece(f"[task {s}] ", shape.question)
        forked = plan + answer
        subagents = []
        for k in range(shape.subagents):
            turn = forked + piece(f"[session {s} sub-agent {k}] ", shape.question)
            turns = [turn]
            for t in range(1, shape.turns):
                turn = turn + answer + piece(f"[tool output {s}.{k}.{t}] ", shape.tool_output)
                turns.append(turn)
            subagents.append(turns)
        merge = forked + [tok for k in range(shape.subagents)
                          for tok in piece(f"[result of sub-agent {s}.{k}] ", shape.tool_output)]
        sessions.append(Session(plan, subagents, merge))
    return sessions


@dataclass(frozen=True)
class SessionTimes:
    """When a session starts (s after the level's start) and the think time before each sub-agent turn 2..turns."""

    start: float
    thinks: list[list[float]]  # [sub-agent][turn - 2]


def session_times(shape: AgenticShape, count: int, rate: float, think_secs: float, arrivals: str,
                  rng: random.Random) -> list[SessionTimes]:
    """Sessions start at `rate` per second; think times of mean `think_secs` (exponential, or fixed with
    "uniform"); the same seed gives every peer the same times."""
    if rate <= 0:
        raise ValueError(f"the session rate must be > 0, got {rate}")
    if think_secs < 0:
        raise ValueError(f"the think time must be >= 0, got {think_secs}")
    out, now = [], 0.0
    for _ in range(count):
        thinks = [[rng.expovariate(1 / think_secs) if arrivals == "poisson" and think_secs > 0 else think_secs
                   for _ in range(shape.turns - 1)] for _ in range(shape.subagents)]
        out.append(SessionTimes(now, thinks))
        now += rng.expovariate(rate) if arrivals == "poisson" else 1 / rate
    return out


@dataclass
class Step:
    """What `run_session` asks of `send`: one request of a session, sent at `due` (perf_counter) or later."""

    session: int
    role: str  # "plan", "subagent", "merge"
    subagent: int | None
    turn: int  # 1-based within its role
    prompt: list[int]


def run_session(session: Session, index: int, times: SessionTimes, t0: float,
                send: Callable[[Step], bool]) -> None:
    """One session against `send` (which makes the request and says whether it succeeded): the plan at the
    session's start; then every sub-agent side by side, each turn after the last one's answer and its think time;
    then the merge once every sub-agent is done. A failed request ends its sub-agent (or the session, for the
    plan); the merge still runs after the others."""
    delay = t0 + times.start - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
    if not send(Step(index, "plan", None, 1, session.plan)):
        return

    def subagent(k: int) -> None:
        for t, prompt in enumerate(session.subagents[k], 1):
            if t > 1:
                time.sleep(times.thinks[k][t - 2])
            if not send(Step(index, "subagent", k, t, prompt)):
                return

    threads = [threading.Thread(target=subagent, args=(k,), daemon=True) for k in range(len(session.subagents))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    send(Step(index, "merge", None, 1, session.merge))
