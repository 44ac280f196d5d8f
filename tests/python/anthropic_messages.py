"""Drives tollgate's Anthropic surface with the official `anthropic` package, unchanged:
a message, plain and streamed; a tool-calling conversation (the model calls a tool, plain
and streamed, its result goes back, the model answers); token counting; errors in
Anthropic's shape.

Run by the e2e test `endpoints::anthropic_python_sdk_sends_and_streams_messages_through_the_queue`,
which passes TOLLGATE_BASE_URL (`http://host:port`) and TOLLGATE_API_KEY. Exits non-zero
on the first failed check; prints a JSON summary on success.
"""

import json
import os

import anthropic
from anthropic import Anthropic
from checks import run

MODEL = "claude-3-5-haiku-latest"
TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


def main():
    client = Anthropic(base_url=os.environ["TOLLGATE_BASE_URL"], api_key=os.environ["TOLLGATE_API_KEY"], max_retries=0)

    raw = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=32, system="Be brief.", messages=[{"role": "user", "content": "Hello there"}]
    )
    job_id = raw.headers["x-tollgate-job-id"]
    message = raw.parse()
    assert message.type == "message" and message.role == "assistant", message
    assert message.content[0].type == "text" and message.content[0].text, message
    assert message.stop_reason in ("end_turn", "max_tokens"), message
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0, message.usage

    with client.messages.stream(model=MODEL, max_tokens=32, messages=[{"role": "user", "content": "Hello"}]) as stream:
        streamed_text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    assert streamed_text and streamed.content[0].text == streamed_text, streamed
    assert streamed.usage.output_tokens > 0 and streamed.stop_reason in ("end_turn", "max_tokens"), streamed

    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    with client.messages.stream(model=MODEL, max_tokens=64, tools=TOOLS, messages=question) as stream:
        streamed_call = stream.get_final_message()
    assert streamed_call.stop_reason == "tool_use", streamed_call
    assert streamed_call.content[0].type == "tool_use" and streamed_call.content[0].input == {"city": "mock"}, streamed_call

    called = client.messages.create(model=f"ant/{MODEL}", max_tokens=64, tools=TOOLS, messages=question)
    assert called.stop_reason == "tool_use", called
    use = next(b for b in called.content if b.type == "tool_use")
    assert use.name == "get_weather" and use.input == {"city": "mock"}, use
    answered = client.messages.create(
        model=MODEL,
        max_tokens=64,
        tools=TOOLS,
        messages=question
        + [
            {"role": "assistant", "content": [b.model_dump() for b in called.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "rain"}]},
        ],
    )
    assert answered.stop_reason in ("end_turn", "max_tokens") and answered.content[0].type == "text", answered

    counted = client.messages.count_tokens(model=MODEL, messages=question, tools=TOOLS)
    assert counted.input_tokens > 10, counted

    try:
        thinking = {"type": "enabled", "budget_tokens": 1024}
        client.messages.create(model="gpt-4o-mini", max_tokens=8, thinking=thinking, messages=question)
        raise AssertionError("thinking was accepted for an OpenAI model")
    except anthropic.BadRequestError as e:
        assert e.body["type"] == "error", e.body
        assert (e.body["error"]["type"], e.body["error"]["code"]) == ("invalid_request_error", "unsupported_field"), e.body
        assert e.body["error"]["param"] == "thinking", e.body
    try:
        client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [{"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}])
        raise AssertionError("a document block was accepted")
    except anthropic.BadRequestError as e:
        assert e.body["error"]["code"] == "unsupported_field", e.body
    try:
        Anthropic(base_url=os.environ["TOLLGATE_BASE_URL"], api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=8, messages=question
        )
        raise AssertionError("a wrong key was accepted")
    except anthropic.AuthenticationError as e:
        assert e.body["error"]["type"] == "authentication_error", e.body

    print(json.dumps({"job": job_id, "message": message.id, "tool_use": use.id}))


if __name__ == "__main__":
    run(main)
