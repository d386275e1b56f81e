"""Rendering, pure: (manifest, host) -> vLLM argv, systemd unit or start script, env file."""
