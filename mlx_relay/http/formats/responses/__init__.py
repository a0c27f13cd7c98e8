"""OpenAI Responses API (`/v1/responses`): the parts every format has (`formats`), its tools and
namespaces (`tools`), stream events (`events`) and the store behind `previous_response_id` (`store`)."""
