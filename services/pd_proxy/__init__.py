"""`kvmesh pd-proxy`: an OpenAI-API proxy in front of prefill (producer) and decode (consumer) vLLMs (proxy.py)."""
