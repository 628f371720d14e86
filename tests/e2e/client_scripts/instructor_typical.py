"""instructor's typical use (run by test_client_envs_e2e.py in its own venv): argv: base
URL, model. A pydantic model extracted in its default mode (a forced tool call) and in
JSON-schema mode, and a partial model streamed as it fills."""

import sys
from typing import Literal

import instructor
import openai
from pydantic import BaseModel, Field

base_url, model = sys.argv[1], sys.argv[2]


class City(BaseModel):
    name: str = Field(max_length=16)
    country: Literal["France", "Italy", "Spain"]


prompt = [{"role": "user", "content": "Describe the capital of France."}]
options = dict(
    model=model, messages=prompt, response_model=City, max_tokens=60, temperature=0, max_retries=0
)


def client(mode=instructor.Mode.TOOLS):
    return instructor.from_openai(
        openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0), mode=mode
    )


for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
    city = client(mode).chat.completions.create(**options)
    assert isinstance(city, City), city
partials = list(client().chat.completions.create_partial(**options))
assert partials and isinstance(partials[-1].country, str), partials
print("ok", instructor.__version__, openai.__version__)
