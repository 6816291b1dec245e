"""The engine process's settings: threads, seeds, malloc tuning, resident memory."""
