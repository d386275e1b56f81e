"""Talking to a vLLM server: HTTP probes, the smoke test, log signatures, readiness gates."""
