"""schemathesis against the HTTP API's OpenAPI schema (in-process ASGI, a pipeline whose
generation is scripted): no 5xx, and only documented status codes and content types."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import build_char_tokenizer
from hypothesis import HealthCheck, settings

from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.launcher import build_http_app
from pagedserve.cluster.pipeline import ChoiceDelta, RequestPipeline, Usage
from pagedserve.cluster.request_prep import ModelInfo
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.request import FinishReason

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    status_code_conformance,
)

MAX_EXAMPLES = 15  # per operation: 4 operations, well under 20 s


def _app() -> Any:
    info = ModelInfo("m", 512, 105, (2,), 512, 8)
    pipeline = RequestPipeline(scheduler=None, tokenizer=build_char_tokenizer(), info=info)

    async def generate(req: EngineRequest, flight: Any):
        for i in range(req.sampling.n):
            usage = Usage(len(req.prompt_token_ids), 2, 0)
            yield ChoiceDelta(i, (40,), "E")
            yield ChoiceDelta(i, (41,), "F", finish_reason=FinishReason.STOP, usage=usage)

    pipeline._generate = generate  # type: ignore[method-assign]
    return build_http_app(ClusterConfig(), pipeline)


APP = _app()
schema = schemathesis.openapi.from_asgi("/openapi.json", APP).include(path_regex="^/v1/")


def test_the_schema_documents_the_request_bodies():
    doc = APP.openapi()
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    ref = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref == "#/components/schemas/ChatCompletionRequest"
    body = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"tools", "tool_choice", "response_format", "structured_outputs"} <= set(body)
    fmt = doc["components"]["schemas"]["JsonSchemaFormat"]["properties"]
    assert {"name", "schema", "strict"} <= set(fmt)
    assert set(chat["responses"]) == {"200", "400", "404", "409", "503"}


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_api_conforms_to_its_schema(case):
    if isinstance(case.body, dict):
        case.body["model"] = "m"  # the served name: past the 404, into the request path
    case.call_and_validate(
        checks=[not_a_server_error, status_code_conformance, content_type_conformance]
    )
