"""An image Worker: upload an image and ask about it.

Either POST the image's bytes (Content-Type image/png, image/jpeg, …) and ask with ?q=..., or POST
a form (multipart/form-data, as a browser or `curl -F` sends it) with an `image` file field and an
optional `question` field. The image goes to the vision model as an OpenAI `image_url` part holding
a data URI, followed by the question. The answer is
{"answer": "...", "bytes": <size of the upload>, "usage": {...}};
Workers AI errors come back as 502 {"error": "<code>: <message>"}.
"""

import base64
from urllib.parse import parse_qs, urlparse

from js import Object
from pyodide.ffi import JsException
from pyodide.ffi import to_js as _to_js
from workers import Response, WorkerEntrypoint

ACCEPTED = ("image/png", "image/jpeg", "image/webp", "image/gif")
MAX_BYTES = 4 * 1024 * 1024
USAGE = "POST an image: curl --data-binary @cat.png -H 'content-type: image/png', or curl -F image=@cat.png"


def to_js(obj):
    return _to_js(obj, dict_converter=Object.fromEntries)


async def read_upload(request, default_question):
    """(image bytes, mime type, question) from a raw upload or a multipart form."""
    question = parse_qs(urlparse(request.url).query).get("q", [default_question])[0]
    mime = (request.headers.get("content-type") or "").split(";")[0].strip().lower()
    if mime != "multipart/form-data":
        return await request.bytes(), mime, question
    form = await request.form_data()
    upload = form.get("image")
    if upload is None or isinstance(upload, str):
        return b"", "", question
    return await upload.bytes(), upload.content_type.lower(), form.get("question") or question


class Default(WorkerEntrypoint):
    async def fetch(self, request):
        if request.method != "POST":
            return Response(USAGE, status=405)
        image, mime, question = await read_upload(request, self.env.DEFAULT_QUESTION)
        if mime not in ACCEPTED:
            return Response.json(
                {"error": f"unsupported image type {mime!r}; send one of {list(ACCEPTED)}"}, status=415
            )
        if not image or len(image) > MAX_BYTES:
            return Response.json({"error": f"the image must be 1 byte to {MAX_BYTES} bytes"}, status=413)

        data_uri = f"data:{mime};base64,{base64.b64encode(image).decode('ascii')}"
        content = [{"type": "image_url", "image_url": {"url": data_uri}}, {"type": "text", "text": question}]
        inputs = {"messages": [{"role": "user", "content": content}], "max_tokens": 32}
        try:
            result = (await self.env.AI.run(self.env.MODEL, to_js(inputs))).to_py()
        except JsException as exc:  # the binding's errors, on Cloudflare as here
            return Response.json({"error": str(exc)}, status=502)
        if "choices" in result:
            answer = result["choices"][0]["message"].get("content") or ""
        else:
            answer = result.get("response", "")
        return Response.json({"answer": answer, "bytes": len(image), "usage": result.get("usage", {})})
