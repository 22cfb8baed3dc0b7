"""What the orchestrator and the workers share, with no I/O and nothing above it: the Responses
API's items (`items`, `untrusted`), a call and its invocation and result (`calls`), call states,
the Redis keys, errors, output truncation, tool limits and permits, the task contract and signing.

Layers, bottom to top: `toolq.core` -> `toolq.workers` -> `toolq.orchestrator`; a lower layer never
imports a higher one (tests/unit/test_import_graph.py).
"""
