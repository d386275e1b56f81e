"""Scripts run ON THE HOST by its own Python (stdlib + what a vLLM venv has); read as text and sent
there by the controller, never imported by it."""
