"""Drives tollgate's legacy Completions with the official `openai` package, unchanged: a
completion, several prompts with `n` choices each, a stream (with its usage chunk), a batch
of completions through the Files and Batch APIs, and the refusals.

Run by the e2e test `endpoints::openai_python_sdk_drives_legacy_completions`, which passes
TOLLGATE_BASE_URL (`http://host:port/v1`) and TOLLGATE_API_KEY. Exits non-zero on the
first failed check; prints a JSON summary on success.
"""

import json
import os

import openai
from checks import run, run_batch
from openai import OpenAI

MODEL = "fast"


def main():
    client = OpenAI(base_url=os.environ["TOLLGATE_BASE_URL"], api_key=os.environ["TOLLGATE_API_KEY"], max_retries=0)

    raw = client.completions.with_raw_response.create(model=MODEL, prompt="Say hello", max_tokens=8)
    job_id = raw.headers["x-tollgate-job-id"]
    completion = raw.parse()
    assert completion.object == "text_completion" and completion.choices[0].text, completion
    assert completion.choices[0].finish_reason in ("stop", "length"), completion
    assert completion.usage.prompt_tokens == 3 and completion.usage.completion_tokens > 0, completion.usage

    raw = client.completions.with_raw_response.create(model=MODEL, prompt=["one", "two"], n=2, max_tokens=5)
    several_id = raw.headers["x-tollgate-job-id"]
    several = raw.parse()
    assert sorted(c.index for c in several.choices) == [0, 1, 2, 3], several

    stream = client.completions.create(
        model=MODEL, prompt="Stream please", max_tokens=8, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text, chunks
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0, chunks[-1]
    assert any(c.choices and c.choices[0].finish_reason for c in chunks), chunks

    for bad, param in ((dict(best_of=2, stream=True), "best_of"), (dict(n=0), "n"), (dict(logprobs=9), "logprobs")):
        try:
            client.completions.create(model=MODEL, prompt="x", **bad)
            raise AssertionError(f"{bad} was accepted")
        except openai.BadRequestError as e:
            assert (e.body["code"], e.body["param"]) == ("invalid_request", param), e.body
    try:
        client.completions.create(model="ant/claude-3-5-haiku-latest", prompt="x")
        raise AssertionError("a completion to Anthropic was accepted")
    except openai.BadRequestError as e:
        assert e.body["code"] == "endpoint_not_served", e.body

    lines = [
        {"custom_id": f"c-{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": MODEL, "prompt": f"number {i}", "max_tokens": 4}}
        for i in range(3)
    ]
    batch, output = run_batch(client, "/v1/completions", lines)
    assert batch.status == "completed" and batch.request_counts.completed == 3, batch
    assert all(o["response"]["body"]["object"] == "text_completion" for o in output), output

    print(json.dumps({"job": job_id, "several": several_id, "batch": batch.id}))


if __name__ == "__main__":
    run(main)
