"""Verifies webhook deliveries tollgate sent with an independent Standard Webhooks
implementation (the `standardwebhooks` package). Argument: a JSON file holding a list of
{"secret": "whsec_...", "headers": {...}, "body": "..."}. Exits non-zero if any
signature does not verify; prints how many did.
"""

import json
import sys

from standardwebhooks import Webhook


def main(path):
    with open(path, encoding="utf-8") as f:
        received = json.load(f)
    assert received, "nothing to verify"
    for r in received:
        payload = Webhook(r["secret"]).verify(r["body"], r["headers"])
        assert payload["type"] and "data" in payload, payload
    print(json.dumps({"verified": len(received)}))


if __name__ == "__main__":
    main(sys.argv[1])
