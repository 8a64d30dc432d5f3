"""`python -m rollout.sglang_launch_server [flags]`: SGLang's `python -m sglang.launch_server` line,
module renamed (rollout.server.sglang_serve)."""

from __future__ import annotations

import logging
import sys

from rollout.server.sglang_serve import main

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(main(sys.argv[1:]))
