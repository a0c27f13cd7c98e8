"""OpenAI Chat Completions (`POST /v1/chat/completions`): the parts every format has (`formats`)."""
