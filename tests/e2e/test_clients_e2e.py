"""The clients people point at an OpenAI-style server, each in its typical use, against the
real server with the embedded model (SmolLM2-135M-Instruct, real weights): the official
`openai` client, langchain-openai, the openai-agents SDK (its Chat Completions model) and
pydantic-ai. Each runs a plain answer, a stream, a tool round trip (the call sent back in
the history as the client builds it, the tool's result answered) and structured output.
Every test ends with /debug/lifecycle at zero in all three processes (the `server`
fixture). (The openai client's structured output, `parse` with a pydantic model, is in
test_default_model_server.py, on the same server.) (The clients that cannot share this environment's pins run from their own: see
test_client_envs_e2e.py.)"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import pytest
from e2e_helpers import DEFAULT_MODEL_SERVER
from pydantic import BaseModel, Field
from test_default_model_server import WEATHER_TOOL  # get_weather(city, unit)

pytestmark = pytest.mark.server(DEFAULT_MODEL_SERVER)

QUESTION = "What is the capital of France?"
WEATHER_QUESTION = "What is the weather like in Paris today?"
WEATHER_RESULT = {"city": "Paris", "temperature": 21, "unit": "celsius", "sky": "sunny"}


class City(BaseModel):
    name: str = Field(max_length=16)
    country: Literal["France", "Italy", "Spain"]


def said_the_result(text: str) -> bool:
    return "21" in text or "sunny" in text.lower()


# ---------------------------------------------------------------- openai
def test_openai_plain_stream_and_model_card(server, client):
    card = client.models.retrieve(server.model_name)
    assert card.id == server.model_name and card.model_extra["max_model_len"] > 0
    resp = client.chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=24,
        temperature=0,
        # what clients send unasked: nulls and official fields of a hosted service
        top_p=None,
        n=None,
        store=False,
        metadata={"test": "clients"},
        service_tier="auto",
        user="tester",
    )
    assert "Paris" in resp.choices[0].message.content
    stream = client.chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == resp.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens


def test_openai_tool_round_trip_with_model_dump_history(server, client):
    """The agent-loop pattern: the answer's message appended with `model_dump()`."""
    messages = [{"role": "user", "content": WEATHER_QUESTION}]
    first = client.chat.completions.create(
        model=server.model_name,
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,  # a small model repeats its call otherwise
        max_tokens=60,
        temperature=0,
    )
    message = first.choices[0].message
    assert message.tool_calls and first.choices[0].finish_reason == "tool_calls"
    messages.append(message.model_dump())  # role, content, refusal, annotations, audio, ...
    for call in message.tool_calls:  # every call answered, as an agent loop does
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"]
        result = json.dumps(WEATHER_RESULT)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    answer = client.chat.completions.create(
        model=server.model_name,
        messages=messages,
        tools=[WEATHER_TOOL],
        max_tokens=48,
        temperature=0,
    )
    assert said_the_result(answer.choices[0].message.content)


# ---------------------------------------------------------------- langchain-openai
@pytest.fixture
def chat_model(server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=server.base_url + "/v1",
        api_key="unused",
        model=server.model_name,
        temperature=0,
        max_tokens=48,
        max_retries=0,
    )


def test_langchain_plain_stream_tools_and_structured_output(chat_model):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    answer = chat_model.invoke(QUESTION)
    assert "Paris" in answer.content and answer.usage_metadata["output_tokens"] > 0
    pieces = list(chat_model.stream(QUESTION))  # sends stream_options.include_usage
    assert "".join(p.content for p in pieces) == answer.content

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return json.dumps({**WEATHER_RESULT, "city": city})

    history = [HumanMessage(WEATHER_QUESTION)]
    call_message = chat_model.bind_tools([get_weather], tool_choice="any").invoke(history)
    (call,) = call_message.tool_calls
    assert call["name"] == "get_weather"
    history += [
        call_message,
        ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]),
    ]
    final = chat_model.bind_tools([get_weather]).invoke(history)
    assert said_the_result(final.content)

    structured = chat_model.with_structured_output(City, method="json_schema")
    assert isinstance(structured.invoke("Describe the capital of France."), City)


# ---------------------------------------------------------------- openai-agents
def test_openai_agents_chat_completions_model_runs_an_agent_with_a_tool(server):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no traces sent to OpenAI
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return json.dumps({**WEATHER_RESULT, "city": city})

    async def main():
        client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        model = OpenAIChatCompletionsModel(model=server.model_name, openai_client=client)
        settings = ModelSettings(temperature=0, max_tokens=60, tool_choice="required")
        agent = Agent(
            name="weather",
            instructions="Answer questions about the weather with the tool.",
            model=model,
            model_settings=settings,  # the first turn must call; then the tool choice resets
            tools=[get_weather],
        )
        result = await Runner.run(agent, WEATHER_QUESTION)
        streamed = Runner.run_streamed(agent, WEATHER_QUESTION)
        events = [e async for e in streamed.stream_events()]
        typed = Agent(
            name="city",
            model=model,
            output_type=City,
            model_settings=ModelSettings(temperature=0, max_tokens=60),
        )
        city = await Runner.run(typed, "Describe the capital of France.")
        await client.close()
        return result, streamed, events, city

    result, streamed, events, city = asyncio.run(main())
    assert calls and all(calls)  # the tool ran, in both runs
    assert isinstance(result.final_output, str) and said_the_result(result.final_output)
    assert streamed.final_output == result.final_output and events
    assert isinstance(city.final_output, City)


# ---------------------------------------------------------------- pydantic-ai
def test_pydantic_ai_agent_plain_stream_tools_and_output(server):
    from pydantic_ai import Agent, UsageLimits
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=server.base_url + "/v1", api_key="unused")
    model = OpenAIChatModel(server.model_name, provider=provider)
    settings = {"temperature": 0, "max_tokens": 48, "parallel_tool_calls": False}
    agent = Agent(model, model_settings=settings)
    assert "Paris" in agent.run_sync(QUESTION).output
    with agent.run_stream_sync(QUESTION) as stream:
        assert "Paris" in "".join(stream.stream_text(delta=True))

    # the first step must call the tool (a small model would not), the next may answer
    def per_step(ctx):
        return {**settings, "tool_choice": "required" if ctx.run_step <= 1 else "auto"}

    calls: list[str] = []
    weather = Agent(model, model_settings=per_step)

    @weather.tool_plain
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return json.dumps({**WEATHER_RESULT, "city": city})

    result = weather.run_sync(WEATHER_QUESTION, usage_limits=UsageLimits(request_limit=4))
    kinds = [part.part_kind for m in result.all_messages() for part in m.parts]
    assert kinds == ["user-prompt", "tool-call", "tool-return", "text"] and calls
    assert said_the_result(result.output)

    typed = Agent(model, model_settings=settings, output_type=City)  # a forced output tool
    assert isinstance(typed.run_sync("Describe the capital of France.").output, City)
