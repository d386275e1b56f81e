"""The command line: click commands (one module per group, imported lazily by main.py), the only error boundary."""
