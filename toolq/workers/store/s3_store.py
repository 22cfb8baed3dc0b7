"""The workspace store in S3 (or any S3-compatible service): one object per blob, `<prefix>/<sha256>`.

boto3 reads the endpoint (`AWS_ENDPOINT_URL`), the region and the credentials from the standard
AWS variables and files, as every AWS tool does. Objects are kept until the bucket's lifecycle rules
remove them: the store sets no expiry of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from toolq.core.environments import blob_id
from toolq.workers.store import StoreError, checked_id, too_big, verified

#: What S3 answers for an object that is not there (GetObject; HeadObject has no body, only the status).
MISSING = {"NoSuchKey", "404", "NotFound"}


class S3Store:
    """`client`: a boto3 S3 client (default: `boto3.client("s3")`, configured by the AWS variables)."""

    def __init__(self, bucket: str, prefix: str, *, max_bytes: int, client: Any = None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.max_bytes = max_bytes
        self.where = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        if client is None:
            try:
                import boto3
            except ImportError:
                raise StoreError("TOOLQ_STORE=s3://... needs boto3: pip install 'toolq[s3]'") from None
            with self._faults():
                client = boto3.client("s3")
        self.client = client

    def key(self, blob: str) -> str:
        blob = checked_id(blob)
        return f"{self.prefix}/{blob}" if self.prefix else blob

    def put(self, data: bytes) -> str:
        if len(data) > self.max_bytes:
            raise too_big(len(data), self.max_bytes)
        blob = blob_id(data)
        if not self.has(blob):
            with self._faults():
                self.client.put_object(Bucket=self.bucket, Key=self.key(blob), Body=data)
        return blob

    def get(self, blob: str) -> bytes:
        key = self.key(blob)
        with self._faults():
            try:
                answer = self.client.get_object(Bucket=self.bucket, Key=key)
            except Exception as e:
                if _code(e) in MISSING:
                    raise StoreError(f"blob {blob[:12]} is not in the workspace store ({self.where})") from None
                raise
            body = answer["Body"]
            try:
                size = int(answer["ContentLength"])
                if size > self.max_bytes:
                    raise too_big(size, self.max_bytes)
                data = body.read()
            finally:
                body.close()
        try:
            return verified(blob, data)
        except StoreError:
            # Dropped so that the next put stores the real bytes (a put skips a blob that is there);
            # credentials that may not delete leave it, and every read refuses it still.
            try:
                self.delete(blob)
            except StoreError:
                pass
            raise

    def has(self, blob: str) -> bool:
        key = self.key(blob)
        with self._faults():
            try:
                self.client.head_object(Bucket=self.bucket, Key=key)
            except Exception as e:
                if _code(e) in MISSING:
                    return False
                raise
        return True

    def delete(self, blob: str) -> None:
        key = self.key(blob)
        with self._faults():
            self.client.delete_object(Bucket=self.bucket, Key=key)

    def close(self) -> None:
        self.client.close()

    @contextmanager
    def _faults(self) -> Iterator[None]:
        """boto3's errors (no credentials, no endpoint, no bucket, access denied) as one line."""
        try:
            yield
        except StoreError:
            raise
        except Exception as e:
            if type(e).__module__.startswith(("botocore", "boto3")):
                raise StoreError(f"workspace store ({self.where}): {e}") from e
            raise


def _code(e: Exception) -> str | None:
    response = getattr(e, "response", None)  # botocore's ClientError
    return response.get("Error", {}).get("Code") if isinstance(response, dict) else None
