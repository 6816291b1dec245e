"""Ollama's API on the inference port (`/api/generate`, `/api/chat`, `/api/embed`, ...): its
request schemas (`schemas`), its reply shapes (`shaping`) and its routes (`routes`), over the
server's one generation path (pagedserve.server.serving.generation)."""
