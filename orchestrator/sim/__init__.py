"""The SIMULATED GPU host: stand-ins for what needs a GPU or the internet (vLLM, nvidia-smi, the Hub)."""
