"""A tool-calling Worker (the older `on_fetch` handler): POST {"prompt": "What's the weather in Oslo?"}.

The model is offered two tools. When it calls one, the Worker runs it here, appends the result as
a `tool` message and calls the model again for the final answer. The reply shows what happened:
{"reply": "...", "tool_calls": [{"name", "arguments", "result"}]}. A request may set
"tool_choice" (e.g. "required") for the first call, and `max_tokens`, `temperature`, `seed` for
both; Workers AI errors come back as 502.
"""

import json

from js import Object
from pyodide.ffi import JsException
from pyodide.ffi import to_js as _to_js
from workers import Response

RATES_TO_USD = {"USD": 1.0, "EUR": 1.1, "GBP": 1.27, "JPY": 0.0067}
CURRENCIES = sorted(RATES_TO_USD)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 40},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "convert_currency",
            "description": "Convert an amount between currencies",
            "parameters": {
                "type": "object",
                "properties": {
                    "amount": {"type": "number"},
                    "from": {"type": "string", "enum": CURRENCIES},
                    "to": {"type": "string", "enum": CURRENCIES},
                },
                "required": ["amount", "from", "to"],
                "additionalProperties": False,
            },
        },
    },
]


def get_weather(city, unit="celsius"):
    # a stand-in weather service: stable per city, so answers can be checked
    celsius = sum(map(ord, city)) % 30
    temperature = celsius if unit == "celsius" else round(celsius * 9 / 5 + 32)
    return {
        "city": city,
        "temperature": temperature,
        "unit": unit,
        "sky": ["sunny", "cloudy", "rainy"][len(city) % 3],
    }


def convert_currency(amount, **currencies):
    source, target = currencies["from"].upper(), currencies["to"].upper()
    return {"result": round(amount * RATES_TO_USD[source] / RATES_TO_USD[target], 2), "currency": target}


PASSED_ON = ("max_tokens", "temperature", "seed")
FUNCTIONS = {"get_weather": get_weather, "convert_currency": convert_currency}


def to_js(obj):
    return _to_js(obj, dict_converter=Object.fromEntries)


def calls_of(result):
    """(id, name, arguments) of each tool call, in either family's shape."""
    if "choices" in result:
        message = result["choices"][0]["message"]
        return [
            (c["id"], c["function"]["name"], json.loads(c["function"]["arguments"] or "{}"))
            for c in message.get("tool_calls") or []
        ]
    return [(f"call{i}", c["name"], c["arguments"]) for i, c in enumerate(result.get("tool_calls") or [])]


def text_of(result):
    if "choices" in result:
        return result["choices"][0]["message"].get("content") or ""
    return result.get("response") or ""


async def on_fetch(request, env):
    try:
        return await converse(env, (await request.json()).to_py())
    except JsException as exc:  # the binding's errors, on Cloudflare as here
        return Response.json({"error": str(exc)}, status=502)


async def converse(env, body):
    prompt = body.get("prompt")
    if not prompt:
        return Response.json({"error": "send a prompt"}, status=400)
    messages = [{"role": "user", "content": prompt}]
    inputs = {"messages": messages, "tools": TOOLS, "max_tokens": 128}
    inputs.update({key: body[key] for key in PASSED_ON if key in body})
    first = (
        await env.AI.run(env.MODEL, to_js({**inputs, "tool_choice": body.get("tool_choice", "auto")}))
    ).to_py()
    calls = calls_of(first)
    if not calls:
        return Response.json({"reply": text_of(first), "tool_calls": []})

    messages.append(
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                for i, n, a in calls
            ],
        }
    )
    made = []
    for call_id, name, arguments in calls:
        try:
            result = FUNCTIONS[name](**arguments)
        except (KeyError, TypeError, ValueError) as exc:
            result = {"error": f"{type(exc).__name__}: {exc}"}
        made.append({"name": name, "arguments": arguments, "result": result})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": json.dumps(result)})

    second = (await env.AI.run(env.MODEL, to_js({**inputs, "messages": messages}))).to_py()
    return Response.json({"reply": text_of(second), "tool_calls": made})
