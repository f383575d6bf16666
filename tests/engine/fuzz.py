"""Run random simulation schedules (tests/support/sim_harness.py) for a while, or replay one seed.

    python tests/engine/fuzz.py --seconds 300            # random seeds for 5 minutes (make fuzz SECONDS=300)
    python tests/engine/fuzz.py --seed 1234              # replay one schedule, logging its steps (make fuzz SEED=1234)
    python tests/engine/fuzz.py --seconds 60 --no-processes   # only schedules without NATS / disk store processes
    python tests/engine/fuzz.py --seed 1234 --no-agreement    # two ranks without the connector's load agreement

Each failing seed is printed with its invariant and the command that replays it; at the end, the number of
schedules run. Exit status 1 if any seed failed.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helpers in support/

from support.sim_harness import SimConfig, SimFailure, run_seed  # noqa: E402


def replay_command(seed: int, processes: bool, agreement: bool = True) -> str:
    return (f"python tests/engine/fuzz.py --seed {seed}" + ("" if processes else " --no-processes")
            + ("" if agreement else " --no-agreement"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to run random seeds")
    parser.add_argument("--seed", type=int, help="replay this one seed (verbose)")
    parser.add_argument("--no-processes", action="store_true",
                        help="never start NATS or a disk store (the seeds' process faults are left out)")
    parser.add_argument("--no-agreement", action="store_true",
                        help="two-rank schedules without the connector's per-step load agreement (shows what it "
                             "prevents: a rank saving KV computed over another rank's failed load)")
    args = parser.parse_args(argv)
    processes, agreement = not args.no_processes, not args.no_agreement
    if args.seed is not None:
        logging.basicConfig(level=logging.WARNING)
        print(SimConfig.draw(args.seed, processes))
        try:
            result = run_seed(args.seed, processes, log=print, agreement=agreement)
        except SimFailure as failure:
            print(f"FAILED: {failure}")
            return 1
        print(f"seed {args.seed} passed: {result}")
        return 0
    logging.disable(logging.CRITICAL)  # the engines' warnings about injected faults are expected
    deadline = time.monotonic() + args.seconds
    chooser = random.Random(int.from_bytes(os.urandom(8), "little"))
    runs, failed = 0, []
    while time.monotonic() < deadline:
        seed = chooser.randrange(1 << 31)
        runs += 1
        try:
            run_seed(seed, processes, agreement=agreement)
        except SimFailure as failure:
            failed.append(seed)
            first = str(failure).splitlines()[0]
            print(f"FAIL seed {seed}: {first}\n  replay: {replay_command(seed, processes, agreement)}  "
                  f"(or make fuzz SEED={seed})", flush=True)
        except Exception as exc:  # the harness itself (a process that never came up...): report, go on
            failed.append(seed)
            print(f"ERROR seed {seed}: {type(exc).__name__}: {exc}\n  replay: {replay_command(seed, processes, agreement)}",
                  flush=True)
    print(f"{runs} schedules run, {len(failed)} failed" + (f": seeds {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
