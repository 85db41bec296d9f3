"""schemathesis against the server's own /openapi.json: requests generated from the schema (valid ones and ones
that break it), a few hundred in all on the fake engine; no answer is a 5xx, and the server is healthy after."""

from __future__ import annotations

import pytest
import schemathesis
from fake_engine import FakeEngine
from hypothesis import HealthCheck, settings
from serving_helpers import MODEL, get, post

from serving.api import BackgroundServer

# A short context and no step delay: a generated request asks for the whole context at most (256 tokens), so
# hundreds of them take seconds; no scripted replies or injected failures (the schema's strings cannot hit them).
_ENGINE = dict(max_model_len=256, step_delay_s=0.0, max_waiting=1024)


@pytest.fixture(scope="module")
def schema_server():
    engine = FakeEngine(**_ENGINE)
    engine.poison = "\x00never-generated-poison\x00"
    with BackgroundServer(engine, model_name=MODEL) as srv:
        yield srv
    assert srv.async_engine.num_in_flight == 0


@pytest.fixture(scope="module")
def api_schema(schema_server):
    return schemathesis.openapi.from_url(schema_server.base_url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=50, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
def test_generated_requests_never_get_a_5xx(case, schema_server):
    response = case.call(timeout=60)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    if response.status_code >= 400:
        err = response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err


def test_healthy_after_the_generated_requests(schema_server):
    statuses = {}
    for family in schema_server.metrics.registry.collect():
        for smp in family.samples:
            if smp.name == "dsv41:http_requests_total":
                key = (smp.labels["route"], smp.labels["status"])
                statuses[key] = statuses.get(key, 0) + smp.value
    assert sum(statuses.values()) >= 200, statuses  # the generated requests did run
    assert not [k for k in statuses if k[1].startswith("5")], statuses
    assert get(schema_server, "/health")[0] == 200
    code, _, ok = post(schema_server, "/v1/completions", {"model": MODEL, "prompt": "still here", "max_tokens": 2})
    assert code == 200 and ok["usage"]["completion_tokens"] == 2
