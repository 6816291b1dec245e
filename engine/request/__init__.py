"""A request and its outputs: inputs (prepare), the request's state, detokenizing, stop strings, pooling."""
