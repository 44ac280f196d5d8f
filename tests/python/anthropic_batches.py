"""Drives tollgate's Message Batches with the official `anthropic` package, unchanged:
create a batch (two good requests and one tollgate refuses), poll it to `ended`, read its
results, cancel a second batch while it runs, list batches page by page, delete one.

Run by the e2e test `endpoints::anthropic_python_sdk_drives_message_batches`, which passes
TOLLGATE_BASE_URL (`http://host:port`) and TOLLGATE_API_KEY. Exits non-zero on the first
failed check; prints a JSON summary on success.
"""

import json
import os
import time

import anthropic
from anthropic import Anthropic
from checks import run

MODEL = "claude-3-5-haiku-latest"


def request(custom_id, model=MODEL, **params):
    return {
        "custom_id": custom_id,
        "params": {"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": "Hello"}], **params},
    }


def wait(client, batch_id, deadline_secs=120):
    deadline = time.time() + deadline_secs
    while True:
        batch = client.messages.batches.retrieve(batch_id)
        if batch.processing_status == "ended":
            return batch
        assert time.time() < deadline, f"message batch {batch_id} still {batch.processing_status}"
        time.sleep(0.2)


def main():
    client = Anthropic(base_url=os.environ["TOLLGATE_BASE_URL"], api_key=os.environ["TOLLGATE_API_KEY"], max_retries=0)

    # Two good requests, one whose `max_tokens` is not a number: errored, the rest run.
    batch = client.messages.batches.create(
        requests=[request("first"), request("second", system="Be brief."), request("bad", max_tokens="lots")]
    )
    assert batch.type == "message_batch" and batch.id.startswith("msgbatch_"), batch
    assert batch.processing_status == "in_progress", batch
    assert batch.request_counts.processing == 3 and batch.results_url is None, batch
    ended = wait(client, batch.id)
    counts = ended.request_counts
    assert (counts.processing, counts.succeeded, counts.errored, counts.canceled, counts.expired) == (0, 2, 1, 0, 0), counts
    assert ended.ended_at is not None and ended.ended_at >= ended.created_at, ended
    assert ended.results_url and ended.results_url.endswith(f"/v1/messages/batches/{batch.id}/results"), ended

    results = {r.custom_id: r.result for r in client.messages.batches.results(batch.id)}
    assert set(results) == {"first", "second", "bad"}, results
    for custom_id in ("first", "second"):
        result = results[custom_id]
        assert result.type == "succeeded", result
        assert result.message.type == "message" and result.message.content[0].text, result
        assert result.message.usage.output_tokens > 0, result
    assert results["bad"].type == "errored", results["bad"]
    assert results["bad"].error.error.type == "invalid_request_error", results["bad"]

    # Cancel: a route limited to one request a minute, so the batch is still running.
    slow = client.messages.batches.create(requests=[request(f"slow-{i}", model="slow-claude") for i in range(4)])
    canceling = client.messages.batches.cancel(slow.id)
    assert canceling.processing_status in ("canceling", "ended"), canceling
    assert canceling.cancel_initiated_at is not None, canceling
    canceled = wait(client, slow.id)
    c = canceled.request_counts
    assert c.canceled >= 1 and c.succeeded + c.canceled == 4 and c.errored == 0, c
    slow_results = list(client.messages.batches.results(slow.id))
    assert sorted(r.result.type for r in slow_results) == sorted(["succeeded"] * c.succeeded + ["canceled"] * c.canceled)

    # Errors come in Anthropic's shape.
    try:
        client.messages.batches.create(requests=[request("same"), request("same")])
        raise AssertionError("a repeated custom_id was accepted")
    except anthropic.BadRequestError as e:
        assert e.body["error"]["type"] == "invalid_request_error", e.body
        assert e.body["error"]["param"] == "requests.1.custom_id", e.body
    try:
        client.messages.batches.retrieve("msgbatch_nonexistent")
        raise AssertionError("a batch that does not exist was found")
    except anthropic.NotFoundError as e:
        assert e.body["error"]["type"] == "not_found_error", e.body

    # List: newest first; the SDK follows `after_id` = last id while `has_more`.
    first_page = client.messages.batches.list(limit=1)
    assert first_page.has_more and first_page.data[0].id == slow.id, first_page
    listed = [b.id for b in client.messages.batches.list(limit=1)]
    assert listed[:2] == [slow.id, batch.id], listed

    deleted = client.messages.batches.delete(batch.id)
    assert deleted.id == batch.id and deleted.type == "message_batch_deleted", deleted
    remaining = [b.id for b in client.messages.batches.list()]
    assert slow.id in remaining and batch.id not in remaining, remaining

    print(json.dumps({"batch": batch.id, "canceled": slow.id, "listed": listed}))


if __name__ == "__main__":
    run(main)
