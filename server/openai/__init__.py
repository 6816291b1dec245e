"""OpenAI's API on the inference port: completions, chat completions, the Responses API,
embeddings and the model list (pagedserve.server.openai.routes)."""
