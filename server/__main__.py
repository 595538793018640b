"""`python -m radixlm.server --model smollm2-135m [--host --port --api-key ...]`"""

from radixlm.server.cli import serve_main

if __name__ == "__main__":
    raise SystemExit(serve_main())
