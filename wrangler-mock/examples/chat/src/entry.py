"""A chat Worker: POST {"prompt": "..."} or {"messages": [...]} (add "stream": true for SSE).

The answer is {"reply": "...", "reasoning": "..." or null, "usage": {...}}; with "stream": true
the model's event stream is passed through unchanged. `max_tokens`, `temperature`, `top_p` and
`seed` in the request are passed on. An `x-session-affinity` header on the request is forwarded to
Workers AI so that the turns of one conversation land where their prefix is cached. Errors from
Workers AI come back as 502 {"error": "<code>: <message>"}.
"""

from js import Object
from pyodide.ffi import JsException
from pyodide.ffi import to_js as _to_js
from workers import Response, WorkerEntrypoint

PASSED_ON = ("max_tokens", "temperature", "top_p", "seed")


def to_js(obj):
    return _to_js(obj, dict_converter=Object.fromEntries)


def answer_of(result):
    """(text, reasoning) of either text-generation family."""
    if "choices" in result:
        message = result["choices"][0]["message"]
        return message.get("content") or "", message.get("reasoning_content")
    return result.get("response", ""), None


class Default(WorkerEntrypoint):
    async def fetch(self, request):
        if request.method != "POST":
            return Response('POST a JSON body: {"prompt": "Hello!"}', status=405)
        body = await request.json()
        if "messages" in body:
            messages = list(body["messages"])
        elif isinstance(body.get("prompt"), str) and body["prompt"]:
            messages = [{"role": "user", "content": body["prompt"]}]
        else:
            return Response.json({"error": "send a prompt or messages"}, status=400)
        if not any(m.get("role") == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.env.SYSTEM_PROMPT})

        inputs = {"messages": messages, "max_tokens": 64}
        inputs.update({key: body[key] for key in PASSED_ON if key in body})
        options = {}
        session = request.headers.get("x-session-affinity")
        if session:
            options["extraHeaders"] = {"x-session-affinity": session}
        if body.get("stream"):
            inputs["stream"] = True

        try:
            result = await self.env.AI.run(self.env.MODEL, to_js(inputs), to_js(options))
        except JsException as exc:  # the binding's errors, on Cloudflare as here
            return Response.json({"error": str(exc)}, status=502)
        if body.get("stream"):
            return Response(result, headers={"content-type": "text/event-stream"})
        result = result.to_py()
        reply, reasoning = answer_of(result)
        return Response.json({"reply": reply, "reasoning": reasoning, "usage": result.get("usage", {})})
