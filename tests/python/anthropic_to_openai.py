"""A tool-calling conversation with the official `anthropic` package against an OpenAI
model behind tollgate: a message (plain and streamed), the model calls a tool (plain and
streamed, the call's input arriving as `input_json_delta`s), the tool's result goes back,
the model answers in text; a JSON schema output format answered as JSON, plain and
streamed; what chat cannot express is refused up front, naming the field.

Run by the e2e test `endpoints::anthropic_sdk_reaches_an_openai_model_and_its_tools`,
which passes TOLLGATE_BASE_URL (`http://host:port`) and TOLLGATE_API_KEY. Exits non-zero
on the first failed check; prints a JSON summary on success.
"""

import json
import os

import anthropic
from anthropic import Anthropic
from checks import run

MODEL = "gpt-4o-mini"
TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
QUESTION = [{"role": "user", "content": "What is the weather in Oslo?"}]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "forecast": {"type": "string"}},
    "required": ["city", "forecast"],
    "additionalProperties": False,
}


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
    assert streamed.stop_reason in ("end_turn", "max_tokens") and streamed.usage.output_tokens > 0, streamed

    called = client.messages.create(model=MODEL, max_tokens=64, tools=TOOLS, messages=QUESTION)
    assert called.stop_reason == "tool_use", called
    use = next(b for b in called.content if b.type == "tool_use")
    assert use.name == "get_weather" and use.input == {"city": "mock"}, use

    with client.messages.stream(model=MODEL, max_tokens=64, tools=TOOLS, messages=QUESTION) as stream:
        deltas = [e.delta.partial_json for e in stream if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
        streamed_call = stream.get_final_message()
    assert streamed_call.stop_reason == "tool_use", streamed_call
    assert streamed_call.content[0].type == "tool_use" and streamed_call.content[0].input == {"city": "mock"}, streamed_call
    assert len(deltas) >= 2 and json.loads("".join(deltas)) == {"city": "mock"}, deltas

    answered_turns = QUESTION + [
        {"role": "assistant", "content": [b.model_dump() for b in called.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "rain"}]},
    ]
    answered = client.messages.create(model=MODEL, max_tokens=64, tools=TOOLS, messages=answered_turns)
    assert answered.stop_reason in ("end_turn", "max_tokens") and answered.content[0].type == "text", answered
    with client.messages.stream(model=MODEL, max_tokens=64, tools=TOOLS, messages=answered_turns) as stream:
        streamed_answer = stream.get_final_message()
    assert streamed_answer.content[0].type == "text" and streamed_answer.content[0].text, streamed_answer

    # Structured output: the schema goes as a strict JSON-schema response_format, and the
    # JSON comes back as the text block, plain and streamed.
    output_config = {"format": {"type": "json_schema", "schema": SCHEMA}}
    structured = client.messages.create(model=MODEL, max_tokens=64, messages=QUESTION, output_config=output_config)
    assert structured.stop_reason == "end_turn", structured
    assert json.loads(structured.content[0].text) == {"city": "mock", "forecast": "mock"}, structured
    with client.messages.stream(model=MODEL, max_tokens=64, messages=QUESTION, output_config=output_config) as stream:
        streamed_json = "".join(stream.text_stream)
    assert json.loads(streamed_json) == {"city": "mock", "forecast": "mock"}, streamed_json

    try:
        client.messages.create(
            model=MODEL, max_tokens=8, messages=QUESTION, output_config={"effort": "low", "format": output_config["format"]}
        )
        raise AssertionError("output_config.effort was accepted for an OpenAI model")
    except anthropic.BadRequestError as e:
        assert (e.body["error"]["code"], e.body["error"]["param"]) == ("unsupported_field", "output_config.effort"), e.body

    try:
        cached = [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]
        client.messages.create(model=MODEL, max_tokens=8, messages=cached)
        raise AssertionError("cache_control was accepted for an OpenAI model")
    except anthropic.BadRequestError as e:
        assert (e.body["error"]["code"], e.body["error"]["param"]) == ("unsupported_field", "messages[0].content[0].cache_control"), e.body

    print(json.dumps({"job": job_id, "message": message.id, "tool_use": use.id}))


if __name__ == "__main__":
    run(main)
