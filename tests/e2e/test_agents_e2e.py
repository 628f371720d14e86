"""Function tools through `POST /v1/responses` on the embedded model (SmolLM2-135M-Instruct
with the shipped tool template), and the openai-agents SDK's default model
(`OpenAIResponsesModel`, the Responses API) running an agent with a function tool against
the server: the model calls the tool with valid arguments, the SDK runs it and sends the
call and its output back as `function_call` / `function_call_output` items, and the agent
ends with an answer, streamed or not (the events of a streamed call are checked in
tests/unit/test_responses.py). The lifecycle is back at zero after each test."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from e2e_helpers import DEFAULT_MODEL_SERVER, openai_client

pytestmark = pytest.mark.server(DEFAULT_MODEL_SERVER)

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "The city"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
QUESTION = "What is the weather like in Paris today?"


def test_a_forced_function_call_and_its_output_sent_back(server, client):
    first = client.responses.create(
        model=server.model_name, input=QUESTION, tools=[WEATHER], tool_choice="required",
        temperature=0, max_output_tokens=100,
    )  # fmt: skip
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    history = [{"role": "user", "content": QUESTION}]
    history += [item.model_dump(exclude_none=True) for item in first.output]  # sent back as parsed
    history += [
        {"type": "function_call_output", "call_id": c.call_id, "output": "Sunny, 24 °C."}
        for c in calls
    ]
    answer = client.responses.create(
        model=server.model_name, input=history, tools=[WEATHER], temperature=0,
        max_output_tokens=30,
    )  # fmt: skip
    assert answer.output and answer.usage.input_tokens > first.usage.input_tokens


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_an_openai_agents_agent_runs_a_function_tool(server, streamed):
    from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
    from agents.models.openai_responses import OpenAIResponsesModel
    from openai import AsyncOpenAI

    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        cities.append(city)
        return f"It is sunny and 24 °C in {city}."

    async def run() -> str:
        client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        agent = Agent(
            name="Weather",
            instructions="You answer questions about the weather. Use the tools.",
            tools=[get_weather],
            model=OpenAIResponsesModel(model=server.model_name, openai_client=client),
            # the first turn must call the tool; the SDK resets the choice after it
            model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=80),
        )
        config = RunConfig(tracing_disabled=True)
        try:
            if not streamed:
                result = await Runner.run(agent, QUESTION, run_config=config, max_turns=4)
            else:
                result = Runner.run_streamed(agent, QUESTION, run_config=config, max_turns=4)
                async for _ in result.stream_events():
                    pass
            return result.final_output
        finally:
            await client.close()

    final = asyncio.run(run())
    assert cities and all(isinstance(c, str) and c for c in cities)
    assert isinstance(final, str)
    with openai_client(server) as c:  # the server is still serving
        assert c.models.list().data[0].id == server.model_name
