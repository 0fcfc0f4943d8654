"""Rollout: the RolloutEngine protocol, the embedded engine and the decode-window work queue."""
