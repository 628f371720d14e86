"""The 1.x openai client's typical use (run by test_client_envs_e2e.py in its own venv):
argv: base URL, model. Plain, stream with usage, a tool round trip with the answer's
`model_dump()` in the history, and structured output with `beta.chat.completions.parse`."""

import json
import sys
from typing import Literal

import openai
from pydantic import BaseModel, Field

assert openai.__version__.startswith("1."), openai.__version__
base_url, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
question = [{"role": "user", "content": "What is the capital of France?"}]

reply = client.chat.completions.create(model=model, messages=question, max_tokens=24, temperature=0)
assert "Paris" in reply.choices[0].message.content, reply
chunks = list(
    client.chat.completions.create(
        model=model, messages=question, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
)  # fmt: skip
assert (
    "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    == reply.choices[0].message.content
)
assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens

tool = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"]},
    },
}  # fmt: skip
messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
first = client.chat.completions.create(
    model=model, messages=messages, tools=[tool], tool_choice="required",
    parallel_tool_calls=False, max_tokens=60, temperature=0,
)  # fmt: skip
(call,) = first.choices[0].message.tool_calls
messages.append(first.choices[0].message.model_dump())
result = {"city": "Paris", "temperature": 21, "unit": "celsius", "sky": "sunny"}
messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
answer = client.chat.completions.create(
    model=model, messages=messages, tools=[tool], max_tokens=48, temperature=0
)
text = answer.choices[0].message.content
assert "21" in text or "sunny" in text.lower(), text


class City(BaseModel):
    name: str = Field(max_length=16)
    country: Literal["France", "Italy", "Spain"]


parsed = client.beta.chat.completions.parse(
    model=model, messages=[{"role": "user", "content": "Describe the capital of France."}],
    max_tokens=60, temperature=0, response_format=City,
)  # fmt: skip
assert isinstance(parsed.choices[0].message.parsed, City), parsed
print("ok", openai.__version__)
