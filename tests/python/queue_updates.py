"""Streams through tollgate with the official `openai` and `anthropic` packages, unchanged,
while the jobs wait for a limit, asking for queue updates (`X-Tollgate-Queue-Updates:
true`): both SDKs skip the SSE comments that say where a job stands and read the stream
as they would without them.

Run by the e2e test `streaming::sdks_stream_as_usual_while_queue_updates_arrive`, which
passes TOLLGATE_BASE_URL (`http://host:port`) and TOLLGATE_API_KEY and has spent the
model's requests so that each call waits. Exits non-zero on the first failed check;
prints a JSON summary on success.
"""

import json
import os

from anthropic import Anthropic
from checks import run
from openai import OpenAI

MODEL = "oai/gpt-4o-mini"
UPDATES = {"x-tollgate-queue-updates": "true"}


def main():
    base, key = os.environ["TOLLGATE_BASE_URL"], os.environ["TOLLGATE_API_KEY"]

    openai = OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
    raw = openai.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Stream while you wait"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers=UPDATES,
    )
    chat_job = raw.headers["x-tollgate-job-id"]
    chunks = list(raw.parse())
    chat_text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chat_text, chunks
    assert chunks[-1].usage and chunks[-1].usage.completion_tokens == 5, chunks[-1]

    anthropic = Anthropic(base_url=base, api_key=key, max_retries=0)
    with anthropic.messages.stream(
        model=MODEL,
        max_tokens=5,
        messages=[{"role": "user", "content": "Stream while you wait too"}],
        extra_headers=UPDATES,
    ) as stream:
        message_text = "".join(stream.text_stream)
        message = stream.get_final_message()
    assert message_text and message.content[0].text == message_text, message
    assert message.usage.output_tokens > 0, message.usage

    print(json.dumps({"chat_job": chat_job, "chat_text": chat_text, "message_text": message_text}))


if __name__ == "__main__":
    run(main)
