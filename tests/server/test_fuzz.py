"""Schemathesis fuzz of the OpenAPI schema: whatever arrives, never a 5xx (bounded examples)."""

from __future__ import annotations

import pytest

from kvtier.server.app import create_app
from tests.server.conftest import ALICE_KEY, start_server, stop_server, tenant_config, wait_idle

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 25  # per operation


@pytest.fixture(scope="module")
def fuzz_server(engine):
    # max_output_tokens keeps valid generations short whatever max_tokens the fuzzer picks;
    # the schema the fuzzer reads is served only when asked for
    config = tenant_config(max_output_tokens=2, api_docs=True)
    srv, thread = start_server(create_app(engine, config))
    yield srv
    stop_server(srv, thread)


def test_fuzz_no_server_errors(fuzz_server, engine):
    schema = schemathesis.openapi.from_url(fuzz_server.base_url + "/openapi.json")
    failures = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 5
    for operation in operations:
        fuzz_operation(operation, fuzz_server.base_url, failures)
    assert not failures, failures[:3]
    wait_idle(engine)


def fuzz_operation(operation, base_url: str, failures: list) -> None:
    from hypothesis import HealthCheck, given, settings

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy())
    def check(case) -> None:
        response = case.call(
            base_url=base_url, headers={"Authorization": f"Bearer {ALICE_KEY}"}, timeout=60
        )
        if response.status_code >= 500:
            failures.append((operation.label, case.body, response.status_code, response.text))

    check()
