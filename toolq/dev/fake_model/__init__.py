"""A scripted fake Responses API server for tests, the demo and benchmarks."""

from toolq.dev.fake_model.server import FakeModel, serve_forever

__all__ = ["FakeModel", "serve_forever"]
