"""Run random simulation schedules (tests/support/sim_harness.py) for a while, or replay one seed.

    python tests/engine/fuzz.py --seconds 300            # random seeds for 5 minutes (make fuzz SECONDS=300)
    python tests/engine/fuzz.py --seed 1234              # replay one schedule, logging its steps (make fuzz SEED=1234)
    python tests/engine/fuzz.py --seconds 60 --kind gdn-fine   # only schedules of one kind of KV cache groups
    python tests/engine/fuzz.py --seconds 60 --no-processes    # only schedules without NATS / disk store processes
    python tests/engine/fuzz.py --seed 1234 --no-agreement     # two ranks without the connector's load agreement
    python tests/engine/fuzz.py --seconds 60 --out-of-process  # every seed's workers as if in other processes

Each seed draws its kind of KV cache groups (sim_kinds.py: full, sliding, mamba2, mamba2-fine, gdn, gdn-fine, eagle,
mla) with its other knobs, so a run mixes them all. Each failing seed is printed with its kind, invariant and the
command that replays it; at the end, the schedules run and failed per kind (and how many showed issue 35 finding
2's interleaving, sim_reuse.py: not a failure on the CPU; and how many stopped where vLLM 0.32 itself served a
Mamba state keyed by the wrong position, sim_miskey.py: not KVMesh's failure; and how many ran their workers as if
in other processes, with how many in-step loads planned from the scheduler's mirror). Exit status 1 if any seed
failed.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import random
import signal
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helpers in support/

from support.sim_harness import (KIND_NAMES, KnownVllmIssue, SimConfig, SimFailure, replay_command,  # noqa: E402
                                 run_seed)


SEEDS_PER_WORKER = 10  # 20 was not enough: a worker reached 23.7 GB at its 19th seed (issue 38, this stop)


def _quiet() -> None:
    logging.disable(logging.CRITICAL)  # the engines' warnings about injected faults are expected


def _run(seed: int, processes: bool, kind: str | None, agreement: bool, out_of_process: bool | None
         ) -> tuple[str, str, int, bool]:
    """One seed in a worker process: ("ok" | "reuse" (finding 2's interleaving shown) | "vllm" (vLLM's own
    mis-keyed Mamba state, sim_miskey.py) | "FAIL" | "ERROR", what, in-step loads planned from the mirror,
    whether the layer pipeline wrote its in-step loads)."""
    try:
        result = run_seed(seed, processes, kind=kind, agreement=agreement, out_of_process=out_of_process)
    except KnownVllmIssue as issue:
        return "vllm", str(issue).splitlines()[0], 0, False
    except SimFailure as failure:
        return "FAIL", str(failure).splitlines()[0], 0, False
    except Exception as exc:  # the harness itself (a process that never came up...): report, go on
        return "ERROR", f"{type(exc).__name__}: {exc}", 0, False
    return ("reuse" if result.reuse else "ok"), "", result.mirror_loads, result.cpu_pipeline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to run random seeds")
    parser.add_argument("--seed", type=int, help="replay this one seed (verbose)")
    parser.add_argument("--kind", choices=KIND_NAMES, help="this kind of KV cache groups instead of the seed's")
    parser.add_argument("--no-processes", action="store_true",
                        help="never start NATS or a disk store (the seeds' process faults are left out)")
    parser.add_argument("--no-agreement", action="store_true",
                        help="two-rank schedules without the connector's per-step load agreement (shows what it "
                             "prevents: a rank saving KV computed over another rank's failed load)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out-of-process", dest="out_of_process", action="store_const", const=True,
                       help="the workers as if in other processes than the scheduler, instead of the seed's draw")
    where.add_argument("--in-process", dest="out_of_process", action="store_const", const=False,
                       help="the workers in the scheduler's process, instead of the seed's draw")
    parser.add_argument("--progress", action="store_true", help="print each seed as it starts")
    args = parser.parse_args(argv)
    processes, agreement, out_of_process = not args.no_processes, not args.no_agreement, args.out_of_process
    if args.seed is not None:
        logging.basicConfig(level=logging.WARNING)
        print(SimConfig.draw(args.seed, processes, args.kind, out_of_process))
        try:
            result = run_seed(args.seed, processes, log=print, kind=args.kind, agreement=agreement,
                              out_of_process=out_of_process)
        except KnownVllmIssue as issue:  # vLLM's failure, not KVMesh's (sim_miskey.py)
            print(f"STOPPED at a known vLLM issue: {issue}")
            return 0
        except SimFailure as failure:
            print(f"FAILED: {failure}")
            return 1
        print(f"seed {args.seed} passed: {result}")
        return 0
    deadline = time.monotonic() + args.seconds
    chooser = random.Random(int.from_bytes(os.urandom(8), "little"))
    runs: Counter[str] = Counter()
    reuse: dict[str, list[int]] = {}  # seeds that showed issue 35 finding 2's interleaving (sim_reuse.py)
    vllm_issue: dict[str, list[int]] = {}  # seeds that stopped where vLLM served a mis-keyed state (sim_miskey.py)
    failed: dict[str, list[int]] = {}
    outside: Counter[str] = Counter()  # schedules whose workers were as if in other processes
    mirror_loads: Counter[str] = Counter()  # their in-step loads planned from the mirror (KV cache groups)
    piped: Counter[str] = Counter()  # schedules whose in-step loads the layer pipeline wrote
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stopped run still prints what it ran
    # Seeds run in a worker process replaced every SEEDS_PER_WORKER seeds: one process running hundreds of seeds
    # grew to tens of GiB (each seed's peak memory grew with what ran before it, though no engine, thread or
    # tensor outlived its seed), and a runaway seed costs its worker, never the run.
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_quiet,
                               max_tasks_per_child=SEEDS_PER_WORKER)
    try:
        while time.monotonic() < deadline:
            seed = chooser.randrange(1 << 31)
            config = SimConfig.draw(seed, processes, args.kind, out_of_process)
            kind = config.kind
            replay = replay_command(seed, args.kind, processes, agreement, out_of_process)
            if args.progress:
                print(f"seed {seed} ({kind}{', out of process' if config.out_of_process else ''})", flush=True)
            try:
                outcome, detail, loads, pipelined = pool.submit(_run, seed, processes, args.kind, agreement,
                                                                out_of_process).result()
            except BrokenProcessPool as exc:  # the worker died (killed, out of memory): a failure of the seed
                outcome, detail, loads, pipelined = "ERROR", f"its worker process died ({exc})", 0, False
                pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_quiet,
                                           max_tasks_per_child=SEEDS_PER_WORKER)
            runs[kind] += 1
            outside[kind] += config.out_of_process
            mirror_loads[kind] += loads
            piped[kind] += pipelined
            if outcome == "reuse":
                reuse.setdefault(kind, []).append(seed)
            elif outcome == "vllm":
                vllm_issue.setdefault(kind, []).append(seed)
            elif outcome in ("FAIL", "ERROR"):
                failed.setdefault(kind, []).append(seed)
                print(f"{outcome} seed {seed} ({kind}): {detail}\n  replay: {replay}", flush=True)
    except KeyboardInterrupt:
        print(f"stopped during seed {seed} ({kind}); the schedules it finished:", flush=True)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    for kind in KIND_NAMES:
        if runs[kind]:
            seeds = failed.get(kind, [])
            print(f"{kind}: {runs[kind]} schedules, {len(seeds)} failed" + (f": seeds {seeds}" if seeds else "")
                  + f"; {outside[kind]} out of process, {piped[kind]} with the layer pipeline"
                  + (f" ({mirror_loads[kind]} in-step loads from the mirror)" if mirror_loads[kind] else "")
                  + (f"; finding 2's interleaving in {len(reuse[kind])} (e.g. seed {reuse[kind][0]})"
                     if kind in reuse else "")
                  + (f"; stopped at vLLM's mis-keyed Mamba state in {len(vllm_issue[kind])} (seeds "
                     f"{vllm_issue[kind][:5]})" if kind in vllm_issue else ""))
    total_failed = sum(len(seeds) for seeds in failed.values())
    print(f"{sum(runs.values())} schedules run, {total_failed} failed; {sum(outside.values())} out of process, "
          f"{sum(mirror_loads.values())} in-step loads planned from the mirror, {sum(piped.values())} with the "
          f"layer pipeline")
    return 1 if total_failed else 0


if __name__ == "__main__":
    sys.exit(main())
