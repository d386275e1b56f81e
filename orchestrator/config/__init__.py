"""Configuration: model manifests, the host inventory, YAML loading with file:line errors."""
