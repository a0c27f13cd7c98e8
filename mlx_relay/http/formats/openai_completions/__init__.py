"""OpenAI legacy Completions (`POST /v1/completions`): the parts every format has (`formats`)."""
