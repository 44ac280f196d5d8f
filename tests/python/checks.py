"""What the SDK check scripts share: running one's `main` so that a failed check prints
its reason on stderr and exits non-zero; running a batch of JSONL lines through the
`openai` package's Files and Batch APIs."""

import json
import sys
import time


def run(main):
    try:
        main()
    except AssertionError as e:
        print(f"check failed: {e!r}", file=sys.stderr)
        raise


def run_batch(client, endpoint, lines, deadline_secs=120):
    """Uploads `lines` (dicts), creates a batch of `endpoint` from them and polls it until
    it ends; the batch and its output lines."""
    data = ("\n".join(json.dumps(l) for l in lines) + "\n").encode()
    uploaded = client.files.create(file=("batch.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")
    deadline = time.time() + deadline_secs
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.time() < deadline, f"batch still {batch.status}"
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    output = []
    if batch.output_file_id:
        output = [json.loads(l) for l in client.files.content(batch.output_file_id).text.splitlines()]
    return batch, output
