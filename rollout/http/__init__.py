"""The HTTP front: OpenAI-compatible and SGLang-compatible routes over the rollout service.

`rollout serve --http PORT` puts it in front of its own engine server; `rollout http --connect
ADDRESS --model DIR` in front of any server or router (`rollout.http.launch.start_front` in code).
Modules: `front` (shared state and checks), `generation` (one request's samples: text, stop
strings, deltas), `sessions` (chat sessions without drift), `openai_routes`, `sglang_routes`,
`schemas` (request bodies), `errors` (OpenAI's and SGLang's error bodies), `app` (FastAPI app and
the uvicorn thread), `launch` (start one). Kept free of imports here: FastAPI loads only when used.
"""
