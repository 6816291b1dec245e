"""The three apps (inference, management, metrics) assembled, started, drained."""
