"""`python -m radixlm.launch_server --model-path ...`: SGLang's launch command, served by RadixLM.

The same server as `python -m radixlm.server`; SGLang's and vLLM's flags are accepted where they
mean what ours do (runtime/launch_flags.py)."""
