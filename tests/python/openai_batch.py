"""Drives tollgate's Files and Batch APIs with the official `openai` package, unchanged:
upload a JSONL file, create a batch, poll it to `completed`, download the output and error
files, cancel a second batch, list batches page by page, list and delete files.

Run by the e2e test `batches_py::openai_python_sdk_drives_files_and_batches`, which passes
TOLLGATE_BASE_URL (`http://host:port/v1`) and TOLLGATE_API_KEY. Exits non-zero on the
first failed check; prints a JSON summary on success.
"""

import json
import os
import time

from checks import run
from openai import OpenAI

TERMINAL = ("completed", "failed", "expired", "cancelled")


def line(custom_id, model, text):
    return json.dumps(
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 16},
        }
    )


def wait(client, batch_id, deadline_secs=120):
    deadline = time.time() + deadline_secs
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in TERMINAL:
            return batch
        assert time.time() < deadline, f"batch {batch_id} still {batch.status}"
        time.sleep(0.2)


def main():
    client = OpenAI(base_url=os.environ["TOLLGATE_BASE_URL"], api_key=os.environ["TOLLGATE_API_KEY"], max_retries=0)

    # Upload: six good lines, one that is not JSON, one duplicate custom_id.
    lines = [line(f"py-{i}", "fast", f"hello {i}") for i in range(6)]
    lines += ["this is not json", line("py-0", "fast", "again")]
    data = ("\n".join(lines) + "\n").encode()
    uploaded = client.files.create(file=("input.jsonl", data), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(data), uploaded
    assert client.files.retrieve(uploaded.id).filename == "input.jsonl"
    assert client.files.content(uploaded.id).content == data

    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"suite": "e2e"},
    )
    assert batch.status in ("validating", "in_progress"), batch.status
    assert batch.metadata == {"suite": "e2e"}, batch.metadata
    batch = wait(client, batch.id)
    assert batch.status == "completed", batch
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (8, 6, 2), counts
    assert batch.completed_at >= batch.created_at

    output = [json.loads(l) for l in client.files.content(batch.output_file_id).text.splitlines()]
    results = {r["custom_id"]: r for r in output}
    assert len(output) == 6 and set(results) == {f"py-{i}" for i in range(6)}, output
    for r in output:
        assert r["response"]["status_code"] == 200, r
        assert r["response"]["body"]["choices"][0]["message"]["content"], r
        assert r["error"] is None, r
    errors = [json.loads(l) for l in client.files.content(batch.error_file_id).text.splitlines()]
    assert sorted(e["error"]["code"] for e in errors) == ["duplicate_custom_id", "invalid_json"], errors
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"

    # Cancel: a batch on a route limited to one request a minute, so it is still running.
    slow = "\n".join(line(f"slow-{i}", "slow", "wait") for i in range(5)).encode()
    slow_file = client.files.create(file=("slow.jsonl", slow), purpose="batch")
    slow_batch = client.batches.create(
        input_file_id=slow_file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    cancelling = client.batches.cancel(slow_batch.id)
    assert cancelling.status in ("cancelling", "cancelled"), cancelling.status
    cancelled = wait(client, slow_batch.id)
    assert cancelled.status == "cancelled", cancelled
    assert cancelled.cancelled_at is not None
    c = cancelled.request_counts
    assert c.total == 5 and c.completed + c.failed == 5, c
    cancel_errors = [json.loads(l) for l in client.files.content(cancelled.error_file_id).text.splitlines()]
    assert len(cancel_errors) == c.failed and all(e["error"]["code"] == "batch_cancelled" for e in cancel_errors)

    # List: newest first; the SDK follows `after` = last id while `has_more`.
    first_page = client.batches.list(limit=1)
    assert first_page.has_more and first_page.data[0].id == slow_batch.id, first_page
    listed = [b.id for b in client.batches.list(limit=1)]
    assert listed == [slow_batch.id, batch.id], listed

    file_ids = {f.id for f in client.files.list()}
    assert {uploaded.id, slow_file.id, batch.output_file_id} <= file_ids, file_ids
    assert client.files.delete(uploaded.id).deleted
    assert uploaded.id not in {f.id for f in client.files.list()}

    print(json.dumps({"batch": batch.id, "cancelled": slow_batch.id, "listed": listed}))


if __name__ == "__main__":
    run(main)
