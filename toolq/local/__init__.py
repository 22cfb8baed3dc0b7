"""The embedded stack: a private Redis-protocol server and prefork workers, started as child
processes when there is no `REDIS_URL`, and the runtime directory other shells find it by."""
