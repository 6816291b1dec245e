"""TorchServe's /predictions surface: request bodies (JSON, text, forms, uploads)."""
