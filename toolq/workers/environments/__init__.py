"""Environments on a worker host (issue 28): trees packed and unpacked safely (`archive`), the
host's base cache and environments (`host`), and the thread that serves the orchestrator's
requests (`agent`). The shared records and keys are in `toolq.core.environments`."""
