"""The recorded fixtures travel with the repository: nothing outside it is read."""

from __future__ import annotations

import io

from tests.paths import FIXTURES, ROOT, SSE_FIXTURES
from toolq.dev.bench import decode


def test_every_fixture_the_readme_lists_is_checked_in():
    readme = (FIXTURES / "README.md").read_text()
    files = sorted(p.relative_to(FIXTURES).as_posix() for p in FIXTURES.rglob("*") if p.is_file())
    data = [f for f in files if f != "README.md" and not f.endswith(".py")]
    assert len(data) == 9
    for f in data:
        assert f"`{f.split('/')[-1]}`" in readme, f"{f} is not described in tests/fixtures/README.md"


def test_the_bench_recording_is_the_same_bytes_as_the_test_fixture():
    assert decode.FIXTURE.is_file()
    assert ROOT in decode.FIXTURE.parents and "tests" not in decode.FIXTURE.parts  # package data
    assert decode.FIXTURE.read_bytes() == (SSE_FIXTURES / decode.FIXTURE.name).read_bytes()


def test_bench_decode_runs_from_package_data_and_both_clients_see_every_event():
    out = io.StringIO()
    result = decode.run(out, target_events=300)
    assert not result.get("skipped"), out.getvalue()
    assert result["events"] > 29  # the 29-event recording, repeated
    assert result["sdk_yielded"] == result["events"]  # the SDK yields one object per frame
    assert result["toolq_yielded"] > 0  # ours only the events toolq acts on
