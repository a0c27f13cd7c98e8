"""Anthropic Messages (`POST /v1/messages`, `/v1/messages/count_tokens`): the parts every format
has (`formats`), and Anthropic's error shape (`errors`)."""
