"""Click commands, one module per group; imported lazily by orchestrator.cli."""
