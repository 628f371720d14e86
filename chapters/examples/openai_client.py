from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:1919/v1", api_key="unused")

reply = client.chat.completions.create(
    model="SmolLM2-135M-Instruct",
    messages=[{"role": "user", "content": "What is the capital of France?"}],
    temperature=0,
    max_tokens=20,
)
print(reply.choices[0].message.content, reply.choices[0].finish_reason, reply.usage)

stream = client.chat.completions.create(
    model="SmolLM2-135M-Instruct",
    messages=[{"role": "user", "content": "What is the capital of France?"}],
    temperature=0,
    max_tokens=20,
    stream=True,
)
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
