"""The HTTP front: OpenAI-compatible and SGLang-compatible routes over the rollout service.

`rollout serve --http PORT` puts it in front of its own engine, called in process
(`rollout.client.in_process.InProcessClient`, `rollout.http.launch.serve_front` in code);
`rollout http --connect ADDRESS --model DIR` in front of any server or router over ZMQ
(`rollout.http.launch.start_front`). In folders: `core/` (what every route shares: `clients`, `front`,
`weights`, `generation`, `sessions`: chat sessions without drift, `tools` and `tool_schema`: tool calls,
`schemas`, `sampling`, `logprobs`, `structured`, `errors`, `disconnects`, `connections`, `guards`,
`metrics_routes`), `openai/` (`openai_routes`), `sglang/` (`sglang_routes`), `vllm/` (`vllm_routes`,
`vllm_weight_routes`, `lora_routes`, `tokenize_routes`); here `app` (the FastAPI app of every folder's
routes and the uvicorn thread) and `launch` (start one). Kept free of imports here: FastAPI loads only
when used.
"""
