"""A chat Worker: POST {"prompt": "..."} or {"messages": [...]} (add "stream": true for SSE).

The answer is {"reply": "...", "usage": {...}}; with "stream": true the model's event stream is
passed through unchanged. An `x-session-affinity` header on the request is forwarded to Workers AI
so that follow-up turns of one conversation land where their prefix is cached.
"""

from js import Object
from pyodide.ffi import to_js as _to_js
from workers import Response, WorkerEntrypoint


def to_js(obj):
    return _to_js(obj, dict_converter=Object.fromEntries)


def reply_text(result):
    """The answer of either text-generation family: `response`, or the first choice's content."""
    if "choices" in result:
        return result["choices"][0]["message"].get("content") or ""
    return result.get("response", "")


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

        inputs = {"messages": messages, "max_tokens": int(body.get("max_tokens", 64))}
        options = {}
        session = request.headers.get("x-session-affinity")
        if session:
            options["extraHeaders"] = {"x-session-affinity": session}

        if body.get("stream"):
            inputs["stream"] = True
            stream = await self.env.AI.run(self.env.MODEL, to_js(inputs), to_js(options))
            return Response(stream, headers={"content-type": "text/event-stream"})

        result = (await self.env.AI.run(self.env.MODEL, to_js(inputs), to_js(options))).to_py()
        return Response.json({"reply": reply_text(result), "usage": result.get("usage", {})})
