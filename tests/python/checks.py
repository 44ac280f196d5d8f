"""What the SDK check scripts share: running one's `main` so that a failed check prints
its reason on stderr and exits non-zero."""

import sys


def run(main):
    try:
        main()
    except AssertionError as e:
        print(f"check failed: {e!r}", file=sys.stderr)
        raise
