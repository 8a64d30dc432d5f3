"""SkyRL's own remote-client tests against `rollout serve --http`, their mock servers swapped for ours.

    python bench/clients/skyrl_client_check.py --skyrl-repo /work/.mirror/NovaSky-AI+SkyRL/repo \
        --skyrl-python /tmp/skyrl-venv/bin/python [--tag skyrl-v0.3.0]

Set-up, once: a Python 3.12 virtual environment with SkyRL's client (`python3.12 -m venv
/tmp/skyrl-venv; pip install torch==2.13.0; pip install skyrl==0.3.0 pytest pytest-asyncio aiohttp
httpx uvicorn fastapi`) and SkyRL's repository (the `fetch` tool's copy) for its test file at the
tag matching the installed package.

The test file is read from the repository at `--tag` into a temporary directory, never into this
one. One change is made to it: its `mock_servers` fixture is renamed out of the way, and a
`conftest.py` beside it provides `mock_servers` as two real `rollout serve --http` processes (a
tiny random Llama with SmolLM2's tokenizer, served as the names SkyRL's tests send), started once
for the module and, since their mocks keep no state, restored after each test (resumed, awake, and
the weights loaded again from disk where a level-2 sleep dropped them). Everything
else in their file runs as written: tests that assert the mock's made-up values (fixed token ids,
"Response 0 from server 1", the mock's `/test/...` introspection routes) fail against a real
engine, and the summary says which tests passed and which failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

TEST_PATH = "tests/backends/skyrl_train/inference_servers/test_remote_inference_client.py"
ROOT = Path(__file__).resolve().parents[2]

CONFTEST = r'''
"""Two `rollout serve --http` processes in place of SkyRL's mock vLLM servers."""
import subprocess, sys, threading, time
from pathlib import Path
import pytest

OUR_PYTHON = {our_python!r}
OUR_ROOT = {our_root!r}
NAMES = ["default", "test", "test-model", "served-alias", "base-model"]
READY = "rollout http: listening on "


def _model_dir(tmp: Path) -> Path:
    code = ("import sys; from pathlib import Path; sys.path.insert(0, %r); "
            "from tests.rollout.http_util import save_tiny_chat_model; "
            "save_tiny_chat_model(Path(%r))") % (OUR_ROOT, str(tmp))
    subprocess.run([OUR_PYTHON, "-c", code], check=True, cwd=OUR_ROOT, timeout=300, capture_output=True)
    return tmp


def _serve(model_dir: Path):
    proc = subprocess.Popen([OUR_PYTHON, "-m", "rollout.cli", "serve", "--model", str(model_dir), "--port", "0",
                             "--threads", "1", "--block-size", "4", "--num-blocks", "2048", "--max-requests", "64",
                             "--max-seq-len", "512", "--http", "0", "--served-model-name", *NAMES],
                            cwd=OUR_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, deadline = [], time.monotonic() + 120

    def read():
        for line in proc.stdout:
            if line.startswith(READY) and not url:
                url.append(line[len(READY):].split()[0])
    threading.Thread(target=read, daemon=True).start()
    while not url and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert url, "rollout serve did not start"
    return proc, url[0]


@pytest.fixture(scope="module")
def _our_servers(tmp_path_factory):
    model_dir = _model_dir(tmp_path_factory.mktemp("tiny-chat"))
    procs = [_serve(model_dir) for _ in range(2)]
    yield model_dir, [u for _, u in procs]
    for proc, _ in procs:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _restore(model_dir: Path, url: str) -> None:
    """What a test left: paused, asleep, or weights dropped by a level-2 sleep (which a mock
    does not mind and an engine does): resumed, awake, and the weights loaded again from disk
    by prime-rl's `/update_weights {{"weight_dir"}}`."""
    import httpx

    with httpx.Client(base_url=url, timeout=60) as web:
        web.post("/resume")
        web.post("/wake_up")
        probe = web.post("/inference/v1/generate", json={{"token_ids": [1], "sampling_params": {{"max_tokens": 1}}}})
        if probe.status_code == 503:
            assert web.post("/update_weights", json={{"weight_dir": str(model_dir)}}).status_code == 200


@pytest.fixture
def mock_servers(_our_servers):
    """Per test, as their stateless mocks are: the same two servers, restored after each test."""
    model_dir, urls = _our_servers
    yield {{"proxy_url": urls[0], "server_urls": urls}}
    for url in urls:
        _restore(model_dir, url)
'''


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skyrl-repo", type=Path, required=True, help="SkyRL's repository (a git directory)")
    parser.add_argument("--skyrl-python", required=True, help="the interpreter with `skyrl` installed")
    parser.add_argument("--tag", default="skyrl-v0.3.0", help="the SkyRL tag whose test file to run")
    parser.add_argument("-k", default=None, help="pytest -k expression")
    parser.add_argument("--keep", type=Path, help="write the run's files and pytest's whole output here")
    args = parser.parse_args(argv)
    source = subprocess.run(["git", "--git-dir", str(args.skyrl_repo), "show", f"{args.tag}:{TEST_PATH}"],
                            check=True, capture_output=True, text=True, timeout=60).stdout
    marker = '@pytest.fixture(scope="module")\ndef mock_servers():'
    if marker not in source:
        raise SystemExit("their mock_servers fixture is not where this script expects it")
    source = source.replace(marker, "def _their_mock_servers():  # replaced by conftest.py's")
    with tempfile.TemporaryDirectory() as tmp:
        here = Path(tmp) if args.keep is None else args.keep
        here.mkdir(parents=True, exist_ok=True)
        (here / "test_remote_inference_client.py").write_text(source)
        (here / "conftest.py").write_text(CONFTEST.format(our_python=sys.executable, our_root=str(ROOT)))
        cmd = [args.skyrl_python, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
               "-o", "asyncio_mode=strict", str(here)]
        if args.k:
            cmd += ["-k", args.k]
        run = subprocess.run(cmd, cwd=here, capture_output=True, text=True, timeout=1800)
        if args.keep is not None:
            (here / "pytest.log").write_text(run.stdout + run.stderr)
    lines = run.stdout.splitlines()
    print("\n".join(line for line in lines if line.startswith(("PASSED", "FAILED", "ERROR", "SKIPPED"))))
    print(lines[-1] if lines else run.stderr[-2000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
