"""Counts, from the code, how many hands a request passes through above the engine core (issue 65).

    python -m tests.layer_counts            # every figure, static and traced (~10 s)
    python -m tests.layer_counts --static   # the static ones only

Static, from the source (AST) of `inference/`, `rollout/` and `weight_sync/`:
- **files per control kind**: for each wire request kind but GENERATE (`rollout.wire.kinds.Kind`), the
  files under `rollout/` that name it: `Kind.<KIND>`, its wire message class, or a function, method or
  attribute named after it in snake case (`Kind.UPDATE_WEIGHTS`, `UpdateWeights`, `update_weights`);
- **files over 500 lines**;
- **types declared twice**: class names defined in more than one module;
- **type aliases declared twice**: module-level `Name = Annotated[...]` definitions repeated in another
  module or under another name;
- **string-kind dispatch**: comparisons (`==`, `!=`, `in`) of a name or attribute ending in `kind`,
  `state`, `status`, `mode` or `reason` with a string literal (or a tuple / set of them);
- **flat modules in `rollout/http/`**.

Traced, from a real run of each path in one process (a tiny Llama): `threading.setprofile` records every
call into those packages while one request runs, after a warm-up request on the same objects:
- **data forms**: the distinct classes of the arguments and return values (not `self`) defined in
  `rollout/`, `weight_sync/` or the engine's API modules (`ENGINE_API`: the request, its sampling, its
  stream, the engine's calls; not the core's scheduler, runner or kernels), or bytes, of objects not
  met during the warm-up (so the engine, clients and servers, alive before the request, do not count);
  "in" until the engine's first step, "out" after;
- **id spaces**: the distinct names of arguments ending in `id` or `ids` that carry a value, in calls
  above the engine core (the same modules);
- **thread hand-offs**: the threads, other than the caller's, that run the packages' code on the
  request's own data (a data form above); a server's housekeeping tick that runs meanwhile on
  its own values is not one.
The paths: a GRPO generate (`RolloutClient.generate`, n = 4) over ZMQ to a `RolloutServer` (the
disaggregated loop's call, without the router), and an OpenAI chat request over HTTP to the front
`rollout serve --http` runs (`InProcessClient` on the engine's loop).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import tempfile
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("inference", "rollout", "weight_sync")
MAX_LINES = 500
DISPATCH_SUFFIXES = ("kind", "state", "status", "mode", "reason")


# -- static ---------------------------------------------------------------------------------------


def _sources(package: str, root: Path = ROOT) -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted((root / package).rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def control_kind_files() -> dict[str, int]:
    """Files under `rollout/` naming each control kind (module docstring)."""
    from rollout.wire import messages
    from rollout.wire.kinds import REQUEST_KINDS, Kind

    classes = {}
    for cls in _subclasses(messages._Request):
        tag = cls.__struct_config__.tag
        if isinstance(tag, int):
            classes[Kind(tag)] = cls.__name__
    counts = {}
    trees = list(_sources("rollout"))
    for kind in sorted(REQUEST_KINDS - {Kind.GENERATE}):
        names = {classes[kind], _snake(classes[kind])}
        counts[kind.name] = sum(_names_kind(tree, kind.name, names) for _, tree in trees)
    return counts


def _subclasses(cls: type) -> Iterator[type]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _names_kind(tree: ast.Module, member: str, names: set[str]) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (
                node.attr in names or (node.attr == member and isinstance(node.value, ast.Name)
                                       and node.value.id == "Kind")):
            return True
        if isinstance(node, ast.Name) and node.id in names:
            return True
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in names:
            return True
    return False


def long_files(root: Path = ROOT) -> dict[str, int]:
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES:
                out[str(path.relative_to(root))] = lines
    return out


def types_declared_twice(root: Path = ROOT) -> dict[str, list[str]]:
    where = defaultdict(list)
    for package in PACKAGES:
        for path, tree in _sources(package, root):
            for node in tree.body:
                if isinstance(node, ast.ClassDef):
                    where[node.name].append(str(path.relative_to(root)))
    return {name: paths for name, paths in sorted(where.items()) if len(paths) > 1}


def type_aliases_declared_twice(root: Path = ROOT) -> dict[str, list[str]]:
    """Module-level type aliases (`Name = Annotated[...]`) whose definition another module, or another name,
    repeats: per definition (its source), the `path:name`s declaring it."""
    where = defaultdict(list)
    for package in PACKAGES:
        for path, tree in _sources(package, root):
            for node in tree.body:
                if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                        and isinstance(node.value, ast.Subscript) and isinstance(node.value.value, ast.Name)
                        and node.value.value.id == "Annotated"):
                    where[ast.unparse(node.value)].append(f"{path.relative_to(root)}:{node.targets[0].id}")
    return {source: names for source, names in sorted(where.items()) if len(names) > 1}


def string_dispatch() -> dict[str, int]:
    """Per file, comparisons of a `*kind` / `*state` / ... name with string literals."""
    out = {}
    for package in PACKAGES:
        for path, tree in _sources(package):
            hits = sum(_is_string_dispatch(node) for node in ast.walk(tree) if isinstance(node, ast.Compare))
            if hits:
                out[str(path.relative_to(ROOT))] = hits
    return out


def _is_string_dispatch(node: ast.Compare) -> bool:
    def named(expr: ast.AST) -> bool:
        name = expr.id if isinstance(expr, ast.Name) else expr.attr if isinstance(expr, ast.Attribute) else ""
        return name.lower().endswith(DISPATCH_SUFFIXES)

    def strings(expr: ast.AST) -> bool:
        if isinstance(expr, ast.Constant):
            return isinstance(expr.value, str)
        if isinstance(expr, (ast.Tuple, ast.Set, ast.List)):
            return bool(expr.elts) and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in expr.elts)
        return False

    ops_ok = all(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops)
    sides = [node.left, *node.comparators]
    return ops_ok and any(named(s) for s in sides) and any(strings(s) for s in sides)


def http_flat_modules() -> int:
    return len(list((ROOT / "rollout" / "http").glob("*.py")))


# -- traced ---------------------------------------------------------------------------------------


@dataclass
class PathTrace:
    """What one request's run touched (module docstring)."""

    forms_in: set[str] = field(default_factory=set)
    forms_out: set[str] = field(default_factory=set)
    id_names: set[str] = field(default_factory=set)
    threads: set[str] = field(default_factory=set)

    def figures(self) -> dict[str, Any]:
        return {"forms_in": len(self.forms_in), "forms_out": len(self.forms_out),
                "forms": sorted(self.forms_in | self.forms_out), "id_spaces": len(self.id_names),
                "id_names": sorted(self.id_names), "thread_hand_offs": len(self.threads),
                "threads": sorted(self.threads)}


class _Tracer:
    """A profile function for every thread: records calls into the packages while `active`."""

    def __init__(self) -> None:
        self.active = False
        self.warm = False
        self.kept: dict[int, Any] = {}  # NOTE: the warm-up's values, held so that no later object takes an id
        self.trace = PathTrace()
        self.stepped = False
        self.caller = ""
        self._roots = tuple(str(ROOT / p) + "/" for p in PACKAGES)
        self._layers = tuple([str(ROOT / "rollout") + "/", str(ROOT / "weight_sync") + "/"])

    def __call__(self, frame, event: str, arg: Any) -> None:
        if not (self.active or self.warm) or event not in ("call", "return"):
            return
        code = frame.f_code
        if not code.co_filename.startswith(self._roots):
            return
        if event == "call":
            if code.co_name == "step" and code.co_filename.endswith("engine_core.py"):
                self.stepped = True
            names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
            values = [(n, frame.f_locals.get(n)) for n in names if n not in ("self", "cls")]
        else:
            values = [("", arg)]
        if self.warm:
            self.kept.update((id(v), v) for _, v in values)
            return
        above = _above_core(code.co_filename, self._layers)
        fresh = False
        for name, value in values:
            if value is None:
                continue
            if above and name and (name.endswith("_id") or name.endswith("_ids") or name in ("id", "ids", "rid")):
                self.trace.id_names.add(name)
            form = _form_of(value)
            if form is not None and id(value) not in self.kept:
                (self.trace.forms_out if self.stepped else self.trace.forms_in).add(form)
                fresh = True
        thread = threading.current_thread().name
        if fresh and thread != self.caller:
            self.trace.threads.add(re.sub(r"[-_ ]?[0-9a-f]*\d[0-9a-f]*$", "", thread))

    def run(self, warm_up: Callable[[], Any], request: Callable[[], Any]) -> PathTrace:
        self.caller = threading.current_thread().name
        self.warm = True
        warm_up()
        self.warm = False
        self.stepped = False
        self.active = True
        try:
            request()
        finally:
            self.active = False
        return self.trace


# the engine's API modules: the forms a request takes from the engine's door outwards (the core's own,
# scheduler, runner, attention, sampler, do not count)
ENGINE_API = ("inference.engine", "inference.request", "inference.streams", "inference.calls",
              "inference.sampling.params")


def _above_core(filename: str, layers: tuple[str, ...]) -> bool:
    """A frame of the layers above the engine core: `rollout/`, `weight_sync/`, the engine's API modules."""
    if filename.startswith(layers):
        return True
    module = ".".join(Path(filename).relative_to(ROOT).with_suffix("").parts)
    return module in ENGINE_API


def _form_of(value: Any) -> str | None:
    import enum

    cls = type(value)
    if cls in (bytes, bytearray, memoryview):
        return "bytes"
    module = getattr(cls, "__module__", "") or ""
    top = module.split(".")[0]
    if isinstance(value, (type, BaseException, enum.Enum)):
        return None
    if top in ("rollout", "weight_sync") or module in ENGINE_API:
        return f"{module}.{cls.__qualname__}"
    return None


def _traced(setup: Callable[[_Tracer], tuple[Callable, Callable, Callable]]) -> dict[str, Any]:
    tracer = _Tracer()
    previous = threading.getprofile()
    threading.setprofile(tracer)
    sys.setprofile(tracer)
    try:
        warm_up, request, close = setup(tracer)
        try:
            trace = tracer.run(warm_up, request)
        finally:
            close()
    finally:
        sys.setprofile(None)
        threading.setprofile(previous)
    return trace.figures()


def grpo_generate_path(work: Path) -> dict[str, Any]:
    from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
    from rollout import RolloutClient
    from rollout.server.server import RolloutServer
    from tests.inference.engine.conftest import tiny_llama

    def setup(tracer: _Tracer):
        engine = DynamicInferenceEngine.from_pretrained(tiny_llama(layers=1, hidden=32, seed=4),
                                                        InferenceConfig(num_blocks=256, max_requests=16))
        server = RolloutServer(engine).start()
        client = RolloutClient(server.address, timeout=60.0)
        sampling = SamplingParams(temperature=1.0, max_tokens=8, seed=1)

        def call():
            return client.generate([[1, 5, 9, 13]], n=4, sampling=sampling)

        def close():
            client.close()
            server.stop()
        return call, call, close

    return _traced(setup)


def openai_chat_path(work: Path) -> dict[str, Any]:
    import urllib.request

    from rollout.client.in_process import InProcessClient
    from rollout.http.launch import serve_front
    from rollout.server.server import RolloutServer
    from tests.rollout.http_util import save_tiny_chat_model

    model_dir = save_tiny_chat_model(work / "chat")

    def setup(tracer: _Tracer):
        from inference import DynamicInferenceEngine, InferenceConfig

        engine = DynamicInferenceEngine.from_pretrained(str(model_dir), InferenceConfig(num_blocks=256,
                                                                                        max_requests=16))
        server = RolloutServer(engine).start()
        client = InProcessClient(server.engine, server.receiver, timeout=60.0)
        front = serve_front(client, model_dir, served_model_name="tiny", on_stop=client.shutdown)
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                           "temperature": 1.0, "seed": 1, "logprobs": True}).encode()

        def call():
            request = urllib.request.Request(f"{front.url}/v1/chat/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as reply:
                return json.loads(reply.read())

        def close():
            front.stop()
            server.stop()
        return call, call, close

    return _traced(setup)


def counts(*, traced: bool = True) -> dict[str, Any]:
    kinds = control_kind_files()
    out: dict[str, Any] = {
        "control_kind_files": kinds, "control_kind_files_max": max(kinds.values()),
        "long_files": long_files(), "types_declared_twice": types_declared_twice(),
        "type_aliases_declared_twice": type_aliases_declared_twice(),
        "string_dispatch": string_dispatch(), "http_flat_modules": http_flat_modules(),
    }
    if traced:
        with tempfile.TemporaryDirectory() as work:
            out["grpo_generate"] = grpo_generate_path(Path(work))
            out["openai_chat"] = openai_chat_path(Path(work))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--static", action="store_true", help="the static counts only")
    args = parser.parse_args(argv)
    print(json.dumps(counts(traced=not args.static), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
