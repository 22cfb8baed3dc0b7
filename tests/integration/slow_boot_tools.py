"""A tool module whose import holds a *worker* back (`toolq worker --tools ...`): with
TOOLQ_TEST_WORKER_BOOT_DELAY=S a worker process sleeps S seconds while loading it, then appends
`time.monotonic()` (one clock for every process on Linux) to TOOLQ_TEST_WORKER_BOOT_MARK. The
orchestrator loads it at once. It declares no tool."""

from __future__ import annotations

import os
import sys
import time

if sys.argv[1:2] == ["worker"] and os.environ.get("TOOLQ_TEST_WORKER_BOOT_DELAY"):
    time.sleep(float(os.environ["TOOLQ_TEST_WORKER_BOOT_DELAY"]))
    mark = os.environ.get("TOOLQ_TEST_WORKER_BOOT_MARK")
    if mark:
        with open(mark, "a") as f:
            f.write(f"{time.monotonic()}\n")
