"""Fixtures every HTTP test module shares; each module says what `model_dir` and `front_url` are."""

from __future__ import annotations

import openai
import pytest

from rollout.text import TextCodec
from tests.rollout.http_util import WAIT_S


@pytest.fixture(scope="module")
def codec(model_dir):
    return TextCodec.load(model_dir)


@pytest.fixture
def oai(front_url):
    with openai.OpenAI(base_url=f"{front_url}/v1", api_key="unused", timeout=WAIT_S, max_retries=0) as c:
        yield c
