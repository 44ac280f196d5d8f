"""Drives tollgate's Responses endpoint with the official `openai` package, unchanged: text
in and out, streamed; a function tool called (plain and streamed) and its output sent
back — with an OpenAI model, and with a Claude model the request reaches as chat; what
tollgate cannot reserve for or translate refused naming the field; a batch of Responses
requests through the Files and Batch APIs.

Run by the e2e test `endpoints::openai_python_sdk_drives_responses`, which passes
TOLLGATE_BASE_URL (`http://host:port/v1`) and TOLLGATE_API_KEY. Exits non-zero on the
first failed check; prints a JSON summary on success.
"""

import json
import os

import openai
from checks import run, run_batch
from openai import OpenAI

MODEL = "gpt-4o-mini"
ANTHROPIC_MODEL = "ant/claude-3-5-haiku-latest"
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


def converse(client, model):
    """Text plain and streamed, a function call plain and streamed, and its output sent
    back, with `model`; the job id of the first call and its response."""
    raw = client.responses.with_raw_response.create(
        model=model, instructions="Be brief.", input="Hello there", max_output_tokens=32
    )
    job_id = raw.headers["x-tollgate-job-id"]
    response = raw.parse()
    assert response.object == "response" and response.status == "completed", response
    assert response.output_text, response
    assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0, response.usage

    deltas, completed = [], None
    for event in client.responses.create(model=model, input=[{"role": "user", "content": "Hi"}], stream=True):
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        elif event.type == "response.completed":
            completed = event.response
    assert completed is not None and "".join(deltas) == completed.output_text, (deltas, completed)
    assert completed.usage.output_tokens > 0, completed.usage

    question = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]}]
    called = client.responses.create(model=model, input=question, tools=TOOLS)
    call = called.output[0]
    assert call.type == "function_call" and call.name == "get_weather", called
    assert json.loads(call.arguments) == {"city": "mock"}, call

    arguments = ""
    with client.responses.stream(model=model, input=question, tools=TOOLS) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                arguments += event.delta
        final = stream.get_final_response()
    assert json.loads(arguments) == {"city": "mock"} and final.output[0].type == "function_call", final

    answered = client.responses.create(
        model=model,
        input=question + [call.model_dump(), {"type": "function_call_output", "call_id": call.call_id, "output": "rain"}],
        tools=TOOLS,
    )
    assert answered.output_text and answered.output[0].type == "message", answered
    return job_id, response


def main():
    client = OpenAI(base_url=os.environ["TOLLGATE_BASE_URL"], api_key=os.environ["TOLLGATE_API_KEY"], max_retries=0)

    job_id, response = converse(client, MODEL)
    # The same conversation with a Claude model: Responses translated to chat and back.
    anthropic_job, _ = converse(client, ANTHROPIC_MODEL)

    for field, extra in [
        ("previous_response_id", {"previous_response_id": response.id}),
        ("tools[0].type", {"tools": [{"type": "web_search"}]}),
    ]:
        try:
            client.responses.create(model=MODEL, input="x", **extra)
            raise AssertionError(f"{field} was accepted")
        except openai.BadRequestError as e:
            assert (e.body["code"], e.body["param"]) == ("unsupported_field", field), e.body
    try:
        client.responses.create(model=ANTHROPIC_MODEL, input="x", reasoning={"effort": "high"})
        raise AssertionError("reasoning was accepted for a chat target")
    except openai.BadRequestError as e:
        assert (e.body["code"], e.body["param"]) == ("unsupported_field", "reasoning"), e.body

    lines = [
        {"custom_id": f"r-{i}", "method": "POST", "url": "/v1/responses",
         "body": {"model": MODEL, "input": f"question {i}", "max_output_tokens": 32}}
        for i in range(3)
    ]
    batch, output = run_batch(client, "/v1/responses", lines)
    assert batch.status == "completed" and batch.request_counts.completed == 3, batch
    assert sorted(r["custom_id"] for r in output) == ["r-0", "r-1", "r-2"], output
    for r in output:
        body = r["response"]["body"]
        assert body["object"] == "response" and body["output"][0]["content"][0]["text"], r

    print(json.dumps({"job": job_id, "anthropic_job": anthropic_job, "batch": batch.id}))


if __name__ == "__main__":
    run(main)
