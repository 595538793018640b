"""Entry point of `python -m radixlm.launch_server` (see __init__.py)."""

import sys

from radixlm.server.cli import serve_main

if __name__ == "__main__":
    sys.exit(serve_main())
