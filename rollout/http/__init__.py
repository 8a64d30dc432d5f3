"""The HTTP front: OpenAI-compatible and SGLang-compatible routes over the rollout service.

`rollout serve --http PORT` puts it in front of its own engine, called in process
(`rollout.client.in_process.InProcessClient`, `rollout.http.launch.serve_front` in code);
`rollout http --connect ADDRESS --model DIR` in front of any server or router over ZMQ
(`rollout.http.launch.start_front`). Modules: `clients` (what the front needs of its client, and
the ZMQ one), `front` (shared state and checks), `weights` (SGLang's weight calls over the client),
`generation` (one request's samples: text, stop strings, deltas), `sessions` (chat sessions without
drift), `tools` (tool calls parsed from chat replies), `openai_routes`, `sglang_routes`, `schemas`
(request bodies), `errors` (OpenAI's and SGLang's error bodies), `disconnects` (a non-streaming
wait cut short when its client leaves), `connections` (read timeouts and the connection bound),
`guards` (Host, content type, body size, API key), `app` (FastAPI app and the uvicorn thread),
`launch` (start one). Kept free of imports here: FastAPI loads only when used.
"""
