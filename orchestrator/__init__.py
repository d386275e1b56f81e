"""vllm-orch: deploy, swap and benchmark vLLM model services on your own GPU machines."""

__version__ = "0.1.0"
