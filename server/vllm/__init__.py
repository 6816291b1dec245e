"""vLLM's extra routes on the inference port (`/tokenize`, `/detokenize`, `/version`,
`/health`): `routes`."""
