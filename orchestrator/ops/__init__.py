"""Operations: session (connect + lock), gathering facts, running plans, deploy/swap/regen/stop/gc/status."""
