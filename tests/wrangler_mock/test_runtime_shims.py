"""The runtime modules' stand-ins: what Worker code written for Cloudflare relies on."""

from __future__ import annotations

import json
import os
import sys
from http import HTTPMethod
from pathlib import Path

import httpx
import pytest
from wrangler_mock import shims
from wrangler_mock.errors import WorkerLoadError
from wrangler_mock.form_data import File, parse_form
from wrangler_mock.jsvalue import JsArray, JsMap, JsObject, ReadableStream
from wrangler_mock.request import Request
from wrangler_mock.response import Response
from wrangler_mock.worker import Env, ExecutionContext, LiveWorker, Worker


async def _body() -> bytes:
    return b'{"a": {"b": [1, {"c": 2}]}}'


def make_request() -> Request:
    return Request(
        "post", "http://w.local/x?y=1", [("Content-Type", "application/json"), ("X-A", "1")], _body
    )


async def test_request_reads_once_and_proxies_json() -> None:
    request = make_request()
    assert request.method == HTTPMethod.POST and request.method == "POST"
    assert request.url == "http://w.local/x?y=1"
    assert request.headers.get("content-type") == "application/json" and request.headers["x-a"] == "1"
    data = await request.json()
    assert data.a.b[1].c == 2 and data["a"]["b"][0] == 1
    assert data.to_py() == {"a": {"b": [1, {"c": 2}]}} and type(data.to_py()["a"]) is dict
    with pytest.raises(OSError, match="Body already used"):
        await request.text()


async def test_response_forms() -> None:
    text = Response("héllo", status=201, headers={"X-Trace": "t"})
    assert (text.status, text.status_text, text.ok) == (201, "Created", True)
    assert text.headers == {"content-type": "text/plain;charset=UTF-8", "x-trace": "t"}
    assert await text.text() == "héllo"
    with pytest.raises(OSError):
        await text.bytes()
    made = Response.json(JsObject(k=JsArray([1, 2])), status=404)
    assert made.status == 404 and made.headers["content-type"] == "application/json"
    assert json.loads(await made.text()) == {"k": [1, 2]}
    assert (await Response.json({"x": 1}).json()).x == 1
    assert Response.redirect("/elsewhere").headers == {"location": "/elsewhere"}
    with pytest.raises(ValueError, match="200 to 599"):
        Response("", status=101)
    with pytest.raises(TypeError, match="body"):
        Response({"not": "serialised"})  # type: ignore[arg-type]


async def test_readable_stream_is_one_shot_and_closes() -> None:
    closed = []

    async def chunks():  # type: ignore[no-untyped-def]
        yield b"a"
        yield b"b"

    async def on_close() -> None:
        closed.append(True)

    stream = ReadableStream(chunks(), on_close)
    assert await stream.bytes() == b"ab" and closed == [True]
    with pytest.raises(TypeError, match="locked"):
        await stream.bytes()


def test_runtime_modules_resolve_to_the_shims() -> None:
    shims.install()
    from js import JSON, Object  # type: ignore[import-not-found]
    from pyodide.ffi import to_js  # type: ignore[import-not-found]
    from workers import Response as WorkersResponse  # type: ignore[import-not-found]

    assert WorkersResponse is Response
    as_map = to_js({"a": {"b": 1}})
    as_object = to_js({"a": {"b": 1}}, dict_converter=Object.fromEntries)
    assert isinstance(as_map, JsMap) and not isinstance(as_object, JsMap)
    assert as_object.a.b == 1 and as_object.to_py() == {"a": {"b": 1}}
    assert JSON.parse('{"x": [1]}').x == [1] and JSON.stringify(as_object) == '{"a":{"b":1}}'


def write_worker(tmp_path: Path, source: str) -> Path:
    main = tmp_path / "worker_under_test.py"
    main.write_text(source, encoding="utf-8")
    return main


async def test_on_fetch_with_env_and_ctx(tmp_path: Path) -> None:
    main = write_worker(
        tmp_path,
        "from workers import Response\n"
        "async def record(env):\n"
        "    env.DONE.append(1)\n"
        "async def on_fetch(request, env, ctx):\n"
        "    ctx.waitUntil(record(env))\n"
        "    return Response(f'{request.method} {env.GREETING}')\n",
    )
    worker = Worker.load(main)
    env, ctx = Env.build({"GREETING": "hi"}, {"DONE": []}), ExecutionContext()
    response = await worker.fetch(make_request(), env, ctx)
    await ctx.drain()
    assert await response.text() == "POST hi" and env.DONE == [1]


async def test_handler_must_return_a_response(tmp_path: Path) -> None:
    main = write_worker(
        tmp_path,
        "from workers import WorkerEntrypoint\n"
        "class Default(WorkerEntrypoint):\n"
        "    def fetch(self, request):\n"
        "        return 'a string'\n",
    )
    with pytest.raises(TypeError, match="not a Response"):
        await Worker.load(main).fetch(make_request(), Env(), ExecutionContext())


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(WorkerLoadError, match="does not exist"):
        Worker.load(tmp_path / "missing.py")
    with pytest.raises(WorkerLoadError, match="no fetch handler"):
        Worker.load(write_worker(tmp_path, "X = 1\n"))
    with pytest.raises(WorkerLoadError, match="ZeroDivisionError"):
        Worker.load(write_worker(tmp_path, "1 / 0\n"))


async def test_live_worker_reloads_edits_including_helpers(tmp_path: Path) -> None:
    helper = tmp_path / "wm_reload_helper.py"

    def edit(path: Path, text: str) -> None:
        path.write_text(text, encoding="utf-8")
        later = path.stat().st_mtime + 2  # a visible change even on coarse-timestamp filesystems
        os.utime(path, (later, later))

    edit(helper, "WORD = 'one'\n")
    main = write_worker(
        tmp_path,
        "from workers import Response\nimport wm_reload_helper\n"
        "async def on_fetch(request):\n    return Response(wm_reload_helper.WORD)\n",
    )
    live = LiveWorker.load(main)

    async def answer() -> str:
        return await (await live.current().fetch(make_request(), Env(), ExecutionContext())).text()

    assert await answer() == "one"
    edit(helper, "WORD = 'two'\n")
    assert await answer() == "two"
    edit(main, "def broken(:\n")
    with pytest.raises(WorkerLoadError, match="SyntaxError"):
        live.current()
    with pytest.raises(WorkerLoadError):
        live.current()
    edit(main, "from workers import Response\nasync def on_fetch(request):\n    return Response('fixed')\n")
    assert await answer() == "fixed"


def test_reload_never_forgets_wrangler_mock_itself() -> None:
    import wrangler_mock.response
    from wrangler_mock.worker import _forget_modules_under

    _forget_modules_under(Path(wrangler_mock.__file__).resolve().parents[1])  # a Worker beside the package
    assert sys.modules["wrangler_mock.response"] is wrangler_mock.response
    assert sys.modules["workers"].Response is Response


async def test_form_data_parses_what_httpx_encodes() -> None:
    payload = bytes(range(256)) + b"\r\n--not-a-boundary\r\n\r\n" + bytes(range(255, -1, -1))
    encoded = httpx.Request(
        "POST",
        "http://w.local/",
        data={"question": "Ünïcode?", "empty": ""},
        files=[("image", ("shape.png", payload, "image/png")), ("image", ("b.txt", b"second", "text/plain"))],
    )
    body = encoded.read()

    async def read() -> bytes:
        return body

    request = Request("POST", "http://w.local/", encoded.headers.items(), read)
    form = await request.form_data()
    assert form["question"] == "Ünïcode?" and form["empty"] == ""
    first, second = form.get_all("image")
    assert isinstance(first, File) and (first.name, first.content_type, first.size) == (
        "shape.png",
        "image/png",
        len(payload),
    )
    assert await first.bytes() == payload
    assert isinstance(second, File) and await second.text() == "second"
    assert list(form) == ["question", "empty", "image"]


async def test_url_encoded_forms_and_refusals() -> None:
    form = parse_form(b"a=1&b=x+y&a=2", "application/x-www-form-urlencoded; charset=utf-8")
    assert form["a"] == "1" and form.get_all("a") == ["1", "2"] and form["b"] == "x y"
    with pytest.raises(TypeError, match="not a form"):
        parse_form(b"{}", "application/json")
