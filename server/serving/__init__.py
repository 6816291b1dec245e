"""What every route's request goes through: the server state, the one generation path (prepare, respond whole or streamed, shape), limits, the error middleware."""
