"""Codex's unified-exec sessions on a fleet: a command still running at `yield_time_ms` stays
alive, and `write_stdin` reaches it on the worker that holds it.

Why a session host process: a prefork pool child persists across tasks, but Celery hands a
worker's tasks to its children arbitrarily, so a `write_stdin` could never be sent to the child
that started the command. Each worker therefore starts one small host process (`host.py`) from
its main process, before the pool forks; every `exec_command` of that worker runs in it, and pool
children talk to it over a unix socket in a 0700 directory (`host_client.py`). The host keeps the
commands that outlive their call, and a per-instance queue `toolq.w.<instance>` (consumed by
that worker only) brings each `write_stdin` to it (`toolq.orchestrator.transport.session_route`).

A session belongs to its conversation (`registry.py`): the orchestrator keeps a conversation key
alive while the conversation lives; the host kills a session when that key is gone, at the idle
and lifetime limits, and when the worker (its parent) goes away.
"""
