"""Planning, pure: steps and plans built from (manifest, host entry, facts, options)."""
