"""OpenAI's Embeddings API (`POST /v1/embeddings`)."""
