"""Fixtures shared by the suite's modules (test_server.py, test_scripted.py): the official SDK clients,
built for the server the requesting module talks to (its module-level BASE and KEY)."""

import anthropic
import openai
import pytest


@pytest.fixture(scope="module")
def oa(request):
    m = request.module
    return openai.OpenAI(base_url=m.BASE + "/v1", api_key=m.KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def an(request):
    m = request.module
    return anthropic.Anthropic(base_url=m.BASE, api_key=m.KEY, max_retries=0, timeout=60)
