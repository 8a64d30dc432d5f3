"""HTTP overhead: the same engine through the HTTP front (`rollout serve --http`, OpenAI
`/v1/completions` with token-id prompts) vs through the ZMQ client vs in process, same run.

Throughput: the GRPO workload of `bench/throughput/rollout_throughput.py` (its `Workload`: seeded prompts of
32-256 tokens, n samples each with its own output length of 16-256 tokens, EOS ignored,
temperature 1.0), one n=1 request per sample with its own `max_tokens`, every request in flight:

* in process (the peer): `DynamicInferenceEngine.generate`, the caller's thread stepping;
* ZMQ: a `rollout serve --http 0` child process on loopback (same model directory, engine
  configuration and torch threads), fed by one `RolloutClient`;
* HTTP: the same child's HTTP front (in that process, calling its engine with no socket between), fed
  by one `httpx.AsyncClient` posting `/v1/completions` with `prompt` as token ids; every answer
  carries its text (decoded by the front) and its `token_ids`.

The model is the bench's tiny Llama (4 layers, hidden 256) over SmolLM2's 49,152-token vocabulary
with SmolLM2's tokenizer, so the front decodes real text. tokens/s = useful tokens / wall time;
the figures are the ratios HTTP / ZMQ and HTTP / in-process. Latency: `--latency-prompt`-token
prompts, `--latency-tokens` greedy tokens, 1 and 64 in flight, through httpx (the openai client's
transport) and through bare keep-alive sockets (the server's share alone); added latency = side -
ZMQ (or in-process) at p50 and p99. Sides alternate (`--repeats`); medians with the load average. `--quick`: 8
prompts x n=4, outputs 8-32. Ends in a `RESULT {json}` line. Exits 1 if a side returned other
token counts than asked.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE: before torch loads OpenMP; see common.py
# NOTE: the repository root first, and as the cwd of the `rollout serve` child: this checkout is measured
os.chdir(Path(__file__).resolve().parents[2])

import asyncio  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402
import torch  # noqa: E402

from bench.common import machine_line, print_result  # noqa: E402
from bench.service.service_overhead import (  # noqa: E402
    engine_config,
    interleaved_throughput,
    latencies,
    overhead_parser,
    pct,
    run_local,
    run_remote,
    run_shape,
    samples,
    server_args,
    warm,
)
from bench.throughput.rollout_workload import FIRST_TOKEN, Budget, Workload, make_workload  # noqa: E402
from inference import SamplingParams  # noqa: E402
from rollout import RolloutClient, RolloutEngine, ServerProcess  # noqa: E402

SMOLLM2_VOCAB = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def tiny_chat_model(directory: Path, seed: int) -> torch.nn.Module:
    """The bench's tiny Llama shape over SmolLM2's vocabulary, saved with SmolLM2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from inference.models.smollm2 import smollm2_dir

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=SMOLLM2_VOCAB, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=1,
                      eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(directory)
    source = smollm2_dir(torch.float32)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, directory / name)
    return model


async def post_all(client: httpx.AsyncClient, bodies: list[dict]) -> list[dict]:
    async def one(body: dict) -> dict:
        r = await client.post("/v1/completions", json=body)
        r.raise_for_status()
        return r.json()

    return await asyncio.gather(*(one(b) for b in bodies))


def completion_bodies(prompts: list[list[int]], params: list[SamplingParams]) -> list[dict]:
    return [{"model": "bench", "prompt": p, "max_tokens": sp.max_tokens, "temperature": sp.temperature,
             "ignore_eos": sp.ignore_eos} for p, sp in zip(prompts, params)]


def run_http(url: str, work: Workload) -> tuple[float, bool]:
    prompts, params = samples(work)
    bodies = completion_bodies(prompts, params)

    async def go() -> list[dict]:
        limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
        async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
            return await post_all(client, bodies)

    start = time.perf_counter()
    answers = asyncio.run(go())
    wall = time.perf_counter() - start
    return wall, [len(a["choices"][0]["token_ids"]) for a in answers] == [p.max_tokens for p in params]


def http_latencies(url: str, concurrency: int, rounds: int, prompt_len: int, tokens: int) -> list[float]:
    async def go() -> list[float]:
        out = []
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
            for r in range(rounds):
                prompts = [[FIRST_TOKEN + (r * concurrency + i) % 1000] * prompt_len for i in range(concurrency)]
                start = time.perf_counter()

                async def one(p: list[int], start: float = start) -> None:
                    await post_all(client, [{"model": "bench", "prompt": p, "max_tokens": tokens, "temperature": 0,
                                             "ignore_eos": True}])
                    out.append(time.perf_counter() - start)

                await asyncio.gather(*(one(p) for p in prompts))
        return out

    return asyncio.run(go())


class RawConnection:
    """A bare HTTP/1.1 keep-alive connection (asyncio streams): the server's share of the latency,
    without an HTTP client library's own per-request cost (httpx: ~1-3 ms in Python)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, url: str) -> RawConnection:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        return cls(reader, writer, host)

    async def post(self, path: str, body: dict) -> dict:
        payload = json.dumps(body).encode()
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        await self.writer.drain()
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        return json.loads(await self.reader.readexactly(length))

    def close(self) -> None:
        self.writer.close()


def raw_latencies(url: str, concurrency: int, rounds: int, prompt_len: int, tokens: int) -> list[float]:
    async def go() -> list[float]:
        conns = [await RawConnection.open(url) for _ in range(concurrency)]
        out = []
        for r in range(rounds):
            prompts = [[FIRST_TOKEN + (r * concurrency + i) % 1000] * prompt_len for i in range(concurrency)]
            start = time.perf_counter()

            async def one(conn: RawConnection, p: list[int], start: float = start) -> None:
                await conn.post("/v1/completions", {"model": "bench", "prompt": p, "max_tokens": tokens,
                                                    "temperature": 0, "ignore_eos": True})
                out.append(time.perf_counter() - start)

            await asyncio.gather(*(one(c, p) for c, p in zip(conns, prompts)))
        for c in conns:
            c.close()
        return out

    return asyncio.run(go())


def main(argv: list[str] | None = None) -> int:
    args = overhead_parser(__doc__.splitlines()[0]).parse_args(argv)
    prompts, n, prompt_len, output_len, kv_gib, rounds = run_shape(args)

    torch.set_num_threads(args.threads)
    print(f"http overhead: HTTP front vs ZMQ client vs in-process engine; {machine_line()}")
    ok = True
    with tempfile.TemporaryDirectory(prefix="http-bench-") as tmp:
        model_dir = Path(tmp) / "tiny-chat"
        model = tiny_chat_model(model_dir, args.seed)
        work = make_workload(prompts, n, prompt_len, output_len, SMOLLM2_VOCAB, args.seed)
        budget = Budget.for_workload(model, work, kv_gib, 2048, 256)
        del model
        print(f"workload: {work.describe()}; KV {budget.kv_tokens:,} tokens, {budget.step_tokens} tokens/step, "
              f"{budget.max_requests} requests, {args.threads} torch threads each side")
        local = RolloutEngine(model_dir, engine_config(budget))
        start = time.perf_counter()
        with ServerProcess(model_dir, *server_args(budget, args.threads), "--http", "0",
                           "--served-model-name", "bench") as server, \
                RolloutClient(server.address, timeout=3600, lease_s=600) as client:
            url = server.http_url
            print(f"server up in {time.perf_counter() - start:.1f} s: ZMQ {server.address}, HTTP {url}")
            sides = {"in-process": lambda: run_local(local.engine, work), "zmq": lambda: run_remote(client, work),
                     "http": lambda: run_http(url, work)}
            warm(lambda p, sp: local.engine.generate(p, sp))
            warm(lambda p, sp: client.generate(p, 1, sp))
            asyncio.run(_warm_http(url))
            tps, good = interleaved_throughput(sides, args.repeats, work)
            ok &= good
            print(f"-- throughput, median of {args.repeats}: in-process {tps['in-process']:.1f}, ZMQ {tps['zmq']:.1f}, "
                  f"HTTP {tps['http']:.1f} tok/s: HTTP / ZMQ {tps['http'] / tps['zmq']:.3f}x, HTTP / in-process "
                  f"{tps['http'] / tps['in-process']:.3f}x, ZMQ / in-process {tps['zmq'] / tps['in-process']:.3f}x")
            print(f"-- latency, {args.latency_prompt}-token prompts, {args.latency_tokens} greedy tokens "
                  "(ms from the call to the answer)")
            print("  http: httpx.AsyncClient (what the openai client uses); raw: bare keep-alive sockets, the "
                  "server's share")
            print(f"{'in flight':>9} {'requests':>8} {'local p50':>10} {'zmq p50':>8} {'http p50':>9} {'raw p50':>8} "
                  f"{'local p99':>10} {'zmq p99':>8} {'http p99':>9} {'raw p99':>8} {'http-zmq':>9} {'raw-zmq':>8}")
            figures = {f"tok_s[{side}]": value for side, value in tps.items()}
            figures.update({"ratio[http / zmq]": tps["http"] / tps["zmq"],
                            "ratio[http / in-process]": tps["http"] / tps["in-process"],
                            "ratio[zmq / in-process]": tps["zmq"] / tps["in-process"]})
            for concurrency in (1, 64):
                lat: dict[str, list[float]] = {"local": [], "zmq": [], "http": [], "raw": []}
                for _ in range(2):  # NOTE: alternate halves, so load drifts hit every side
                    half = max(1, rounds[concurrency] // 2)
                    a = (concurrency, half, args.latency_prompt, args.latency_tokens)
                    lat["local"] += latencies(local, *a)
                    lat["zmq"] += latencies(client, *a)
                    lat["http"] += http_latencies(url, *a)
                    lat["raw"] += raw_latencies(url, *a)
                p50 = {k: 1e3 * pct(v, 0.5) for k, v in lat.items()}
                p99 = {k: 1e3 * pct(v, 0.99) for k, v in lat.items()}
                print(f"{concurrency:>9} {len(lat['local']):>8} {p50['local']:>10.2f} {p50['zmq']:>8.2f} "
                      f"{p50['http']:>9.2f} {p50['raw']:>8.2f} {p99['local']:>10.2f} {p99['zmq']:>8.2f} "
                      f"{p99['http']:>9.2f} {p99['raw']:>8.2f} {p50['http'] - p50['zmq']:>+9.2f} "
                      f"{p50['raw'] - p50['zmq']:>+8.2f}")
                figures.update({
                    f"added_ms_p50[http vs in-process, {concurrency} in flight]": p50["http"] - p50["local"],
                    f"added_ms_p50[http vs zmq, {concurrency} in flight]": p50["http"] - p50["zmq"],
                    f"added_ms_p50[raw http vs zmq, {concurrency} in flight]": p50["raw"] - p50["zmq"]})
            print_result("http_overhead", figures, repeats=args.repeats, threads=args.threads,
                         workload=work.describe())
        local.close()
    print(f"done; {machine_line()}")
    if not ok:
        print("ERROR: a side returned other token counts than asked for", file=sys.stderr)
        return 1
    return 0


async def _warm_http(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await post_all(client, completion_bodies([[FIRST_TOKEN + i] * 40 for i in range(4)],
                                                 [SamplingParams(max_tokens=4, ignore_eos=True)] * 4))


if __name__ == "__main__":
    sys.exit(main())
