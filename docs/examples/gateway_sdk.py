"""The gateway with OpenAI's own Python package, unchanged: only `base_url` and the key
point at the gateway."""

import os

from openai import OpenAI

client = OpenAI(
    base_url=os.environ.get("GATEWAY", "http://localhost:8000") + "/v1",
    api_key=os.environ.get("KEY", "sk-local"),
)

answer = client.completions.create(model="echo", prompt="Hello", max_tokens=8)
print(answer.choices[0].text, answer.usage.completion_tokens if answer.usage else None)

stream = client.completions.create(
    model="echo",
    prompt="Once upon a time",
    max_tokens=16,
    stream=True,
    stream_options={"include_usage": True},
)
text = ""
for chunk in stream:
    if chunk.choices:
        text += chunk.choices[0].text
    elif chunk.usage is not None:  # the last chunk: no choices, the usage
        print(repr(text), chunk.usage.total_tokens)
