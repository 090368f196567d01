"""The embedded default model served by our own engine answers a simple question sensibly."""

import openai
import pytest

from tests.processes import running_worker

pytestmark = pytest.mark.slow  # serves the default model from a worker process


def test_default_model_names_the_capital_of_france_greedy():
    with running_worker("default", "--num-blocks", "256") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", temperature=0, max_tokens=24,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
