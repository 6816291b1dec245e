"""Anthropic's Messages API on the inference port (`POST /v1/messages`,
`POST /v1/messages/count_tokens`): its request schemas (`schemas`), its replies and stream
events (`shaping`) and its routes (`routes`), over the server's one generation path
(pagedserve.server.serving.generation)."""
