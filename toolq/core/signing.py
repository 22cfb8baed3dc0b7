"""Signed messages on the queue: whoever reaches Redis still cannot run a call or answer one.

A leaked Redis password (or a command that read the broker URL) lets a process push tasks and
publish result metas. With a fleet key that commands never see (`TOOLQ_SIGNING_KEY`), the
orchestrator signs each invocation it sends and each worker's result backend signs each meta it
stores (STARTED, SUCCESS, FAILURE, REVOKED); a worker refuses an invocation that fails the check
(it is not run) and the orchestrator ignores a meta that fails it (the call keeps waiting for the
genuine one). Both refusals are logged.

The MAC is HMAC-SHA256 over a canonical JSON encoding (sorted keys, no spaces, ASCII) of a
purpose tag, the task id and the whole content, so a genuine signature cannot be moved: not to
another call (the task id names the turn, step, output index and call id), nor from an
invocation to a result. Canonical JSON is stable across the trip through Redis: both sides encode
the same decoded structure.

No Celery here: the orchestrator, the worker's task and its result backend all import it.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from functools import lru_cache
from typing import Any

from toolq.core.errors import ConfigurationError

log = logging.getLogger("toolq.signing")

#: The meta field that carries a result's signature (beside Celery's status, result, task_id...).
META_FIELD = "toolq_signature"
#: The Celery conf key the worker app keeps the fleet key under (Celery masks `*KEY*` in `inspect conf`).
CONF_KEY = "toolq_signing_key"
MIN_KEY_CHARS = 32
GENERATE = "python3 -c 'import secrets; print(secrets.token_hex(32))'"

_INVOCATION = "toolq.invocation.v1"
_META = "toolq.result-meta.v1"
_OUTPUT = "toolq.call-output.v1"
_ENV_REQUEST = "envreq"
_ENV_REPLY = "envrep"
_PROCESS_EVENT = "toolq.process-event.v1"
_HOST_NAMESPACE = "toolq.host-namespace.v1"


def _reduce(o: Any) -> Any:
    """What kombu's JSON encoder does with an object that has `__json__` (a task's return value)."""
    reducer = getattr(o, "__json__", None)
    if reducer is None:
        raise TypeError(f"{type(o).__name__} is not JSON serialisable")
    return reducer()


def canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=_reduce).encode()


class Signer:
    """Signs and checks with one fleet key. Holds the key in a slot, never in a repr."""

    __slots__ = ("_key",)

    def __init__(self, key: str) -> None:
        if len(key) < MIN_KEY_CHARS:
            raise ValueError(f"the signing key must have at least {MIN_KEY_CHARS} characters; "
                             f"generate one with {GENERATE}")
        self._key = key.encode()

    def __repr__(self) -> str:
        return "Signer(****)"

    def _mac(self, purpose: str, task_id: str, body: Any) -> str:
        message = canonical({"purpose": purpose, "task_id": task_id, "body": body})
        return hmac.digest(self._key, message, "sha256").hex()  # the one-shot C path: no HMAC object per call

    def _matches(self, signature: Any, purpose: str, task_id: str, body: Any) -> bool:
        if not isinstance(signature, str) or not signature:
            return False
        expected = self._mac(purpose, task_id, body)
        # Constant time: a mismatch must not tell an attacker how many leading characters were right.
        return hmac.compare_digest(signature.encode("utf-8", "replace"), expected.encode())

    def host_namespace_key(self) -> bytes:
        """The key a host's namespace holder and the workers joining it prove themselves with
        (`workers/environments/namespace.py`): derived, so that process never holds the fleet's."""
        return bytes.fromhex(self._mac(_HOST_NAMESPACE, "", {}))

    # --- invocations: the orchestrator signs, the worker checks -------------------------------

    def sign_invocation(self, task_name: str, task_id: str, invocation: dict[str, Any]) -> str:
        return self._mac(_INVOCATION, task_id, {"task": task_name, "invocation": invocation})

    def invocation_refusal(self, task_name: str, task_id: str, invocation: Any, signature: Any,
                           now: float | None = None) -> str | None:
        """Why this task must not run, or None. `task_id` is the id the task was delivered under."""
        if not signature:
            return "it carries no signature"
        if not self._matches(signature, _INVOCATION, task_id, {"task": task_name, "invocation": invocation}):
            return "its signature does not match (forged, altered, or replayed under another task id)"
        deadline = invocation.get("deadline") if isinstance(invocation, dict) else None
        if isinstance(deadline, (int, float)) and (now if now is not None else time.time()) > deadline:
            # A genuine message replayed after its turn: Celery's `expires` is in the unsigned
            # headers, so the signed deadline is what stops it.
            return "its deadline has passed (a replay of an old call)"
        return None

    # --- result metas: each worker's backend seals, the orchestrator checks -------------------

    def seal_meta(self, meta: dict[str, Any]) -> dict[str, Any]:
        """The meta with its signature added, over every other field."""
        body = {k: v for k, v in meta.items() if k != META_FIELD}
        return {**body, META_FIELD: self._mac(_META, str(body.get("task_id")), body)}

    def meta_refusal(self, task_id: str, meta: Any) -> str | None:
        """Why a meta read for `task_id` is not genuine, or None."""
        if not isinstance(meta, dict):
            return "it is not a result meta"
        signature = meta.get(META_FIELD)
        if not signature:
            return "it carries no signature"
        body = {k: v for k, v in meta.items() if k != META_FIELD}
        if not self._matches(signature, _META, task_id, body):
            return "its signature does not match (forged, altered, or replayed from another call)"
        return None

    # --- a running call's output: the worker seals each batch, the orchestrator checks -----------

    def seal_output(self, task_id: str, seq: int, text: str) -> dict[str, Any]:
        """One batch of streamed output; `seq` orders the batches (a replayed one is refused)."""
        return {"seq": seq, "text": text, "sig": self._mac(_OUTPUT, task_id, {"seq": seq, "text": text})}

    def output_genuine(self, task_id: str, message: Any) -> bool:
        if not isinstance(message, dict) or not isinstance(message.get("text"), str):
            return False
        return self._matches(message.get("sig"), _OUTPUT, task_id, {"seq": message.get("seq"),
                                                                    "text": message["text"]})

    # --- environments (issue 28): the orchestrator signs a request, the host seals its reply -------
    # On the wire (`core.environments`): a request is LPUSHed to `host_requests_key(host)` as the JSON
    # `{"request": <EnvRequest>, "sig": sign_env_request(...)}`; its reply to `reply_key(request id)`
    # as `seal_env_reply(<EnvReply>)` = `{"reply": <EnvReply>, "sig": ...}`. The request id binds
    # both: a reply cannot answer another request, nor a request pass for a reply.

    def sign_env_request(self, request: dict[str, Any]) -> str:
        return self._mac(_ENV_REQUEST, str(request.get("id")), request)

    def env_request_refusal(self, request: Any, signature: Any, now: float | None = None) -> str | None:
        """Why a host must not act on this request, or None."""
        if not isinstance(request, dict):
            return "it is not an environment request"
        if not signature:
            return "it carries no signature"
        if not self._matches(signature, _ENV_REQUEST, str(request.get("id")), request):
            return "its signature does not match (forged or altered)"
        deadline = request.get("deadline")
        if not isinstance(deadline, (int, float)) or (now if now is not None else time.time()) > deadline:
            return "its deadline has passed (the orchestrator stopped waiting, or a replay)"
        return None

    def seal_env_reply(self, reply: dict[str, Any]) -> dict[str, Any]:
        return {"reply": reply, "sig": self._mac(_ENV_REPLY, str(reply.get("id")), reply)}

    def env_reply_genuine(self, request_id: str, message: Any) -> bool:
        """Whether `message` (a sealed reply read from `reply_key(request_id)`) answers that request."""
        if not isinstance(message, dict) or not isinstance(message.get("reply"), dict):
            return False
        reply = message["reply"]
        return reply.get("id") == request_id and self._matches(message.get("sig"), _ENV_REPLY, request_id, reply)

    # --- a front door's process stream (issue 29): the worker's pool child seals each event ---------
    # `key` is the Redis stream key; the event's own counter `n` is in the body, so an entry cannot be
    # moved to another stream nor replayed at another place in its own (the reader checks `n`).

    def seal_process_event(self, key: str, event: dict[str, Any]) -> str:
        return self._mac(_PROCESS_EVENT, key, event)

    def process_event_genuine(self, key: str, event: Any, signature: Any) -> bool:
        return isinstance(event, dict) and self._matches(signature, _PROCESS_EVENT, key, event)

    def accept_meta(self, task_id: str, meta: Any) -> bool:
        """True for a genuine meta; a refused one is logged (the caller drops it)."""
        reason = self.meta_refusal(task_id, meta)
        if reason is None:
            return True
        status = meta.get("status") if isinstance(meta, dict) else None
        log.warning("refused a %s result for task %s: %s; still waiting for the genuine one", status or "bad",
                    task_id, reason)
        return False


@lru_cache(maxsize=8)
def signer_for(key: str | None) -> Signer | None:
    """One Signer per key (the worker's backend and task look it up on every call)."""
    return Signer(key) if key else None


def refuse_invocation(key: str | None, task_name: str, task_id: str, invocation: Any, signature: Any) -> str | None:
    """The worker's check before a task runs: why it must not run, or None."""
    signer = signer_for(key)
    if signer is None:
        return "this worker has no TOOLQ_SIGNING_KEY to check it with"
    return signer.invocation_refusal(task_name, task_id, invocation, signature)


def seal_stored(key: str | None, data: Any) -> Any:
    """The worker's backend, before it stores a task meta: the meta with its signature."""
    signer = signer_for(key)
    if signer is None or not (isinstance(data, dict) and "task_id" in data and "status" in data):
        return data  # not a task meta (a group, an exception's args), or a process with no key
    return signer.seal_meta(data)


def genuine_stored(key: str | None, task_id: str, meta: dict[str, Any]) -> dict[str, Any]:
    """The worker's backend, reading a stored meta: a forged one reads as absent.

    Celery never overwrites a stored SUCCESS (a lost worker's late result must not replace a
    real one), so a forged SUCCESS stored first would keep the genuine result from ever being
    stored and published. Read as PENDING, it is overwritten by the genuine one instead."""
    signer = signer_for(key)
    if signer is None or meta.get("status") != "SUCCESS":
        return meta  # only a stored SUCCESS blocks a later store (other states come back decoded)
    reason = signer.meta_refusal(task_id, meta)
    if reason is None:
        return meta
    log.warning("stored %s result for task %s is not genuine (%s); overwriting it", meta.get("status"), task_id,
                reason)
    return {"status": "PENDING", "result": None}


def required_signer(key: str | None, who: str) -> Signer:
    """The fleet's signer, or one clear line saying how to make a key."""
    if not key:
        raise ConfigurationError(
            f"{who} needs TOOLQ_SIGNING_KEY, the fleet's shared key that signs calls and results "
            f"(the same value on every worker and orchestrator); generate one with: {GENERATE}")
    try:
        return Signer(key)
    except ValueError as e:
        raise ConfigurationError(f"invalid setting signing_key (TOOLQ_SIGNING_KEY): {e}") from None
