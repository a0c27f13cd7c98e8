"""The wire formats the server speaks, one package each, every one with the same parts:

    openai_chat/          POST /v1/chat/completions
    openai_completions/   POST /v1/completions
    anthropic/            POST /v1/messages, /v1/messages/count_tokens
    responses/            POST /v1/responses, GET and DELETE /v1/responses/{id}

    types.py      the wire types (msgspec): request bodies decode straight into them, answers
                  encode from them; and a reply's facts in the format's words (usage, ...)
    request.py    the wire request -> the front-end-neutral `ChatRequest` (`mlx_relay.service`)
    encoder.py    reply events -> the format's SSE frames: an `http.streaming.SSEEncoder`
                  (`start`, `event`, `failed`, `end`, `done`)
    collector.py  reply events -> the non-streamed body: an `http.streaming.Collect`
    routes.py     the routes: a `route.FormatRoutes` (decode the body, check the model, the neutral
                  request, then `respond`: stream through the encoder or collect one body), and a
                  `<format>_routes(config, service, check_model)` that the app mounts

Errors answer in OpenAI's shape (`http/errors.py`) except Anthropic's (`anthropic/errors.py`).
Responses adds its tools and namespaces (`tools.py`), its stream events (`events.py`) and the
store behind `previous_response_id` (`store.py`). The `speculation` body extension and the
usage's drafts per source are written once for all four (`speculation.py`). Chat and
completions fold each choice with the in-process API's `chat.reply.ReplyCollector`; completions
share chat's usage object and stream end. Nothing here holds state past a request but the
Responses store, owned by its routes.
"""
