"""KVMeshConnector with its scheduler-side hooks timed, for benchmarks/scheduler_lookup.py.

    --kv-transfer-config '{"kv_connector":"TimedKVMeshConnector","kv_connector_module_path":"timed_connector",
                           "kv_role":"kv_both"}'
    PYTHONPATH=benchmarks:...  KVMESH_TIMED_CONNECTOR_OUT=/path/timed.jsonl

It subclasses `kvmesh.services.engine.connector.KVMeshConnector` and only wraps methods that every version of
that class has (vLLM's connector API: get_num_new_matched_tokens, update_state_after_alloc, build_connector_meta,
update_connector_output, request_finished; the last-but-one is a no-op of vLLM's base class where KVMesh does not
override it), so the same file times the old connector (c2baa25) and the new one unchanged. A connector that
supports hybrid KV cache groups (SupportsHMA, as KVMesh's does now) finishes requests through
request_finished_all_groups instead, timed as request_finished.

Each hook is timed with `time.perf_counter()` (wall time of vLLM's scheduler thread spent inside the connector,
waits on NATS included) and `time.thread_time()` (CPU time of that thread). Per request id:

  * get_num_new_matched_tokens, update_state_after_alloc, request_finished: the request's own call(s).
  * build_connector_meta: one call per scheduler step; its time is split equally among the requests scheduled
    in that step (scheduled_new_reqs + scheduled_cached_reqs). A step that schedules none (e.g. vLLM spinning
    while a lookup is "ask again") is split among the requests in flight (looked up, not yet written out); a
    step with nothing in flight goes to a per-process "unattributed" total, written with every line.
  * update_connector_output: split equally among the requests in flight at that moment (it carries no request
    ids; vLLM calls it after request_finished in the same update_from_output, so a finishing request still
    counts as in flight then).

A finished request's line is written at the end of the update_connector_output that follows its
request_finished, or 0.2 s after request_finished at the latest (vLLM skips update_connector_output when a
step has no connector output). Time accrued to a request after its line was written is not lost: it goes to
the "unattributed" total. One JSON line per finished request, appended to the file named by
KVMESH_TIMED_CONNECTOR_OUT (nothing is written when it is unset). Only the scheduler role writes.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

import kvmesh.services.engine.connector as _connector_module
from kvmesh.services.engine.connector import KVMeshConnector

OUT_ENV = "KVMESH_TIMED_CONNECTOR_OUT"
HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "update_connector_output", "request_finished")
FLUSH_DELAY_S = 0.2
SOURCE = os.path.realpath(_connector_module.__file__)
log = logging.getLogger("kvmesh.timed_connector")  # "kvmesh" has the connector's handler: lines reach vLLM's log


def _zero() -> dict[str, Any]:
    return {"calls": 0, "wall_s": 0.0, "cpu_s": 0.0}


class _Record:
    def __init__(self, req_id: str, started: float | None = None, started_unix: float | None = None) -> None:
        self.req_id = req_id
        self.hooks: dict[str, dict[str, Any]] = {hook: _zero() for hook in HOOKS}
        self.first_lookup_wall = started_unix if started_unix is not None else time.time()
        self.first_lookup = started if started is not None else time.perf_counter()
        self.answered_after_s: float | None = None  # from the first call's start to the end of the first
        # call that answered (not None)
        self.answers: list[int | None] = []
        self.lookup_calls: list[tuple[float, float]] = []  # (wall, cpu) of each get_num_new_matched_tokens
        self.num_computed_tokens: list[int] = []
        self.steps = 0
        self.finished = False

    def add(self, hook: str, wall: float, cpu: float, share: float = 1.0) -> None:
        entry = self.hooks[hook]
        entry["calls"] += 1  # calls it took part in (a shared step counts once per request)
        entry["wall_s"] += wall * share
        entry["cpu_s"] += cpu * share

    def as_json(self, unattributed: dict[str, Any]) -> dict[str, Any]:
        none_answers = sum(1 for a in self.answers if a is None)
        return {
            "req_id": self.req_id,
            "pid": os.getpid(),
            "first_lookup_unix_s": self.first_lookup_wall,
            "lookup_answered_after_s": self.answered_after_s,
            "lookup_calls": len(self.answers),
            "lookup_call_wall_cpu_s": self.lookup_calls,
            "lookup_none_answers": none_answers,
            "num_external_tokens": next((a for a in self.answers if a is not None), None),
            "num_computed_tokens": self.num_computed_tokens[:1],
            "steps": self.steps,
            "hooks": self.hooks,
            "total_wall_s": sum(h["wall_s"] for h in self.hooks.values()),
            "total_cpu_s": sum(h["cpu_s"] for h in self.hooks.values()),
            "unattributed_so_far": unattributed,
        }


class TimedKVMeshConnector(KVMeshConnector):
    """KVMeshConnector whose scheduler-side hooks are timed per request (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._timed_path = os.environ.get(OUT_ENV) if role == KVConnectorRole.SCHEDULER else None
        self._timed_lock = threading.Lock()
        self._timed: dict[str, _Record] = {}  # in flight: looked up, line not yet written
        self._timed_unattributed: dict[str, dict[str, Any]] = {hook: _zero() for hook in HOOKS}
        log.info("TimedKVMeshConnector (%s): KVMeshConnector from %s; timing to %s", role.name.lower(), SOURCE,
                 self._timed_path)

    # ---- bookkeeping ------------------------------------------------------------------------------------------
    def _record(self, req_id: str, started: float | None = None, started_unix: float | None = None) -> _Record:
        record = self._timed.get(req_id)
        if record is None:
            record = self._timed[req_id] = _Record(req_id, started, started_unix)
        return record

    def _spread(self, hook: str, req_ids: list[str], wall: float, cpu: float) -> None:
        if not req_ids:
            self._timed_unattributed[hook]["calls"] += 1
            self._timed_unattributed[hook]["wall_s"] += wall
            self._timed_unattributed[hook]["cpu_s"] += cpu
            return
        share = 1.0 / len(req_ids)
        for req_id in req_ids:
            self._record(req_id).add(hook, wall, cpu, share)

    def _flush(self, only_finished: bool = True) -> None:
        """Write the lines of finished requests (caller holds the lock)."""
        done = [r for r in self._timed.values() if r.finished or not only_finished]
        if not done or not self._timed_path:
            for record in done:
                self._timed.pop(record.req_id, None)
            return
        snapshot = json.loads(json.dumps(self._timed_unattributed))
        with open(self._timed_path, "a") as out:
            for record in done:
                out.write(json.dumps(record.as_json(snapshot)) + "\n")
                self._timed.pop(record.req_id, None)

    def _flush_later(self) -> None:
        def flush() -> None:
            with self._timed_lock:
                self._flush()

        timer = threading.Timer(FLUSH_DELAY_S, flush)
        timer.daemon = True
        timer.start()

    # ---- the timed hooks ----------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        unix0, wall0, cpu0 = time.time(), time.perf_counter(), time.thread_time()
        result = super().get_num_new_matched_tokens(request, num_computed_tokens)
        wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
        if self._timed_path:
            with self._timed_lock:
                record = self._record(request.request_id, wall0, unix0)
                record.add("get_num_new_matched_tokens", wall, cpu)
                record.answers.append(result[0])
                record.lookup_calls.append((wall, cpu))
                record.num_computed_tokens.append(num_computed_tokens)
                if result[0] is not None and record.answered_after_s is None:
                    record.answered_after_s = time.perf_counter() - record.first_lookup
        return result

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
        if self._timed_path:
            with self._timed_lock:
                self._spread("update_state_after_alloc", [request.request_id], wall, cpu)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        meta = super().build_connector_meta(scheduler_output)
        wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
        if self._timed_path:
            scheduled = [new.req_id for new in scheduler_output.scheduled_new_reqs]
            scheduled += list(scheduler_output.scheduled_cached_reqs.req_ids)
            with self._timed_lock:
                self._flush()
                targets = scheduled or [r.req_id for r in self._timed.values() if not r.finished]
                for req_id in targets:
                    self._record(req_id).steps += 1
                self._spread("build_connector_meta", targets, wall, cpu)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        super().update_connector_output(connector_output)
        wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
        if self._timed_path:
            with self._timed_lock:
                self._spread("update_connector_output", list(self._timed), wall, cpu)
                self._flush()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._timed_finish(request, lambda: super(TimedKVMeshConnector, self).request_finished(request,
                                                                                                      block_ids))

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM calls this one instead of request_finished on a connector that supports hybrid KV cache groups
        (KVMesh does since its hybrid work): timed the same way."""
        return self._timed_finish(request, lambda: super(TimedKVMeshConnector, self).request_finished_all_groups(
            request, block_ids))

    def _timed_finish(self, request: Any, call: Any) -> tuple[bool, dict[str, Any] | None]:
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        result = call()
        wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
        if self._timed_path:
            with self._timed_lock:
                if request.request_id in self._timed:
                    record = self._timed[request.request_id]
                    record.add("request_finished", wall, cpu)
                    record.finished = True
                    self._flush_later()
                else:  # never looked up by this connector (or already written): not a request we time
                    self._spread("request_finished", [], wall, cpu)
        return result

    def shutdown(self) -> None:
        if self._timed_path:
            with self._timed_lock:
                self._flush(only_finished=False)
        super().shutdown()


__all__ = ["TimedKVMeshConnector", "OUT_ENV", "SOURCE"]
