"""A tool-calling conversation with the official `openai` package against an Anthropic
model behind tollgate: the model calls a tool (plain and streamed, the call's arguments
arriving as deltas), the tool's result goes back, the model answers in text; an image
part is carried; a JSON-schema answer comes back as JSON text (plain and streamed); what
Anthropic cannot express is refused up front, naming the field.

Run by the e2e test `adapters::openai_sdk_tool_calls_reach_anthropic_and_come_back`, which
passes TOLLGATE_BASE_URL (`http://host:port/v1`) and TOLLGATE_API_KEY. Exits non-zero on
the first failed check; prints a JSON summary on success.
"""

import json
import os

import openai
from checks import run
from openai import OpenAI

MODEL = "ant/claude-3-5-haiku-latest"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
PIXEL = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="


def main():
    client = OpenAI(base_url=os.environ["TOLLGATE_BASE_URL"], api_key=os.environ["TOLLGATE_API_KEY"], max_retries=0)
    question = [
        {"role": "system", "content": "You answer with tools."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the weather where this picture was taken?"},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PIXEL}"}},
            ],
        },
    ]

    called = client.chat.completions.create(model=MODEL, messages=question, tools=TOOLS, tool_choice="required", max_tokens=64)
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather", call
    assert json.loads(call.function.arguments) == {"city": "mock"}, call.function.arguments
    assert call.id.startswith("toolu_"), call.id

    streamed_calls = {}
    finish = None
    for chunk in client.chat.completions.create(
        model=MODEL, messages=question, tools=TOOLS, parallel_tool_calls=False, max_tokens=64, stream=True
    ):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for delta in c.delta.tool_calls or []:
                entry = streamed_calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                entry["id"] = delta.id or entry["id"]
                if delta.function and delta.function.name:
                    entry["name"] = delta.function.name
                if delta.function and delta.function.arguments:
                    entry["arguments"] += delta.function.arguments
    assert finish == "tool_calls", finish
    assert list(streamed_calls) == [0], streamed_calls
    assert streamed_calls[0]["name"] == "get_weather", streamed_calls
    assert json.loads(streamed_calls[0]["arguments"]) == {"city": "mock"}, streamed_calls

    answer = client.chat.completions.create(
        model=MODEL,
        messages=question
        + [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"},
        ],
        tools=TOOLS,
        max_tokens=64,
    )
    assert answer.choices[0].finish_reason in ("stop", "length"), answer
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls, answer

    # A tool result that answers no call is the provider's 400, not a lost job.
    try:
        client.chat.completions.create(
            model=MODEL, messages=question + [{"role": "tool", "tool_call_id": "toolu_nope", "content": "x"}], max_tokens=8
        )
        raise AssertionError("a stray tool result was accepted")
    except openai.BadRequestError as e:
        assert e.body["code"] == "provider_rejected_request", e.body

    # Structured output: the schema's JSON as the answer's text, plain and streamed.
    weather = {"type": "json_schema", "json_schema": {"name": "weather", "schema": TOOLS[0]["function"]["parameters"]}}
    structured = client.chat.completions.create(model=MODEL, messages=question, max_tokens=64, response_format=weather)
    assert json.loads(structured.choices[0].message.content) == {"city": "mock"}, structured
    assert structured.choices[0].finish_reason == "stop" and not structured.choices[0].message.tool_calls, structured
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=question, max_tokens=64, response_format=weather, stream=True
        )
    )
    streamed_json = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert json.loads(streamed_json) == {"city": "mock"}, chunks
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"], chunks

    for field, extra in [
        ("response_format", {"response_format": weather, "tools": TOOLS}),
        ("response_format.json_schema.schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array"}}}}),
        ("n", {"n": 2}),
        ("logprobs", {"logprobs": True}),
    ]:
        try:
            client.chat.completions.create(model=MODEL, messages=question, max_tokens=8, **extra)
            raise AssertionError(f"{field} to Anthropic was accepted")
        except openai.BadRequestError as e:
            assert (e.body["code"], e.body["param"]) == ("unsupported_field", field), e.body

    print(json.dumps({"call": call.id, "streamed": streamed_calls[0]["id"], "answer": answer.id}))


if __name__ == "__main__":
    run(main)
