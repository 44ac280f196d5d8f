"""Drives tollgate's endpoints beside chat with the official `openai` package, unchanged:
embeddings (the SDK's default base64 encoding and floats), moderations, the model list,
and a batch of embeddings through the Files and Batch APIs.

Run by the e2e test `endpoints::openai_python_sdk_embeds_lists_models_and_batches_embeddings`,
which passes TOLLGATE_BASE_URL (`http://host:port/v1`) and TOLLGATE_API_KEY. Exits
non-zero on the first failed check; prints a JSON summary on success.
"""

import json
import os
import time

import openai
from checks import run
from openai import OpenAI

MODEL = "text-embedding-3-small"


def main():
    client = OpenAI(base_url=os.environ["TOLLGATE_BASE_URL"], api_key=os.environ["TOLLGATE_API_KEY"], max_retries=0)

    # The SDK asks for base64 unless told otherwise and decodes the vectors itself.
    default = client.embeddings.create(model=MODEL, input=["first text", "second text"], dimensions=6)
    assert [d.index for d in default.data] == [0, 1], default
    assert all(len(d.embedding) == 6 and isinstance(d.embedding[0], float) for d in default.data), default
    assert default.usage.prompt_tokens == 6 and default.usage.total_tokens == 6, default.usage
    floats = client.embeddings.create(model=f"emb/{MODEL}", input="one", encoding_format="float")
    assert len(floats.data) == 1 and len(floats.data[0].embedding) == 8, floats
    raw = client.embeddings.with_raw_response.create(model=MODEL, input=[1, 2, 3])
    job_id = raw.headers["x-tollgate-job-id"]
    assert raw.parse().usage.prompt_tokens == 3

    try:
        client.embeddings.create(model="ant/claude-3-5-haiku-latest", input="x")
        raise AssertionError("an embeddings request to Anthropic was accepted")
    except openai.BadRequestError as e:
        assert e.body["code"] == "endpoint_not_served", e.body

    moderation = client.moderations.create(model="omni-moderation-latest", input=["fine text", "also fine"])
    assert len(moderation.results) == 2 and not moderation.results[0].flagged, moderation

    models = {m.id: m for m in client.models.list()}
    assert {"fast", "oai/gpt-4o-mini", MODEL, f"emb/{MODEL}"} <= set(models), models
    assert models["fast"].owned_by == "tollgate", models["fast"]
    assert client.models.retrieve(MODEL).id == MODEL
    assert client.models.retrieve(f"emb/{MODEL}").owned_by == "emb"

    lines = [
        json.dumps({"custom_id": f"e-{i}", "method": "POST", "url": "/v1/embeddings",
                    "body": {"model": MODEL, "input": f"text number {i}", "encoding_format": "float"}})
        for i in range(4)
    ]
    # A chat line does not belong in an embeddings batch.
    lines.append(json.dumps({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
                             "body": {"model": "fast", "messages": [{"role": "user", "content": "hi"}]}}))
    uploaded = client.files.create(file=("embeddings.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    assert batch.endpoint == "/v1/embeddings", batch
    deadline = time.time() + 120
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.time() < deadline, f"batch still {batch.status}"
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (5, 4, 1), counts
    output = [json.loads(l) for l in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in output) == [f"e-{i}" for i in range(4)], output
    for r in output:
        body = r["response"]["body"]
        assert r["response"]["status_code"] == 200 and body["object"] == "list", r
        assert len(body["data"][0]["embedding"]) == 8 and body["usage"]["prompt_tokens"] > 0, r
    errors = [json.loads(l) for l in client.files.content(batch.error_file_id).text.splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("chat", "invalid_url")], errors

    print(json.dumps({"job": job_id, "batch": batch.id, "models": sorted(models)}))


if __name__ == "__main__":
    run(main)
