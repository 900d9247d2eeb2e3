"""`kumo serve`: the embedded default on one machine (DESIGN §5).

On first start it converts the small trained checkpoints committed under `models/` (issue 7) to
INT4 routed experts and an FP8 KV cache with calibrated scales (`kumo quantize`), into the data
dir (cached; redone when the source bytes change). It spawns one `kumo backend` per model on
loopback with a generated secret, waits until every backend is ready, and only then listens; it
prints the URL, a development (paid) tenant's account id and token and the admin token (kept in
the data dir, `gateway.dev_credentials`), and stops everything on Ctrl-C or SIGTERM.

Ports are held from the moment they are chosen (schemas/listen.py): the gateway's `--port` is bound
first (a port in use is an error before anything loads), and each backend's loopback port is bound
here and handed to the backend as its socket (`--listen-fd`), so no other process can take it while
the backend loads; a restarted backend binds the same port again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from gateway.app import create_app
from gateway.catalog import Catalog, CatalogError, load_catalog_file, local_model_spec
from gateway.dev_credentials import DevCredentials, credentials_path, ensure_dev_credentials
from gateway.lifecycle import DrainingServer
from gateway.observability import configure_logging
from gateway.server import uvicorn_config
from gateway.services import open_services
from gateway.settings import GatewaySettings, add_common_arguments, child_environment, settings_from
from gateway.supervisor import Supervised, Supervisor
from schemas.backend import MAX_RANKS, parse_speculative
from schemas.catalog import ModelSpec, PoolsFile, PoolSpec
from schemas.child_process import die_with_parent
from schemas.listen import bind, in_use, listen, port_of

DEFAULT_PORT = 8787
TRAINED = Path(__file__).resolve().parents[1] / "models"
DEFAULT_MODELS = {"kimi-k2.6": "kimi-k2.6-nano", "glm-5.2": "glm-5.2-nano"}  # pool → folder in models/
SERVED_WEIGHTS = "int4-g32"  # the served configuration: INT4 routed experts …
SERVED_KV = "fp8"  # … and an FP8 KV cache (scales calibrated by `kumo quantize --kv-scales`)
SOURCE_STAMP = "kumo-source.sha256"
READY_TIMEOUT_S = 900.0
STOP_GRACE_S = 15.0  # a stopping backend's time to drain before it is killed
PAGE_SIZE = 16  # the backend's default page size, in tokens


class ServeError(Exception):
    """Something that stops `kumo serve` from starting; the message is for the user."""


@dataclass
class BackendProcess:
    name: str
    folder: Path
    pool: str
    port: int
    secret: str
    kv_dtype: str = "auto"
    max_pages: int | None = None  # None: the backend's default pool
    speculative: str = "off"  # `--speculative mtp:K` (backend/engine/speculative/decoder.py)
    process: asyncio.subprocess.Process | None = None
    listener: socket.socket | None = None  # its port's bound socket, held until the process takes it

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reserve_port(self, port: int = 0) -> None:
        """Bind loopback `port` (0: one the kernel picks, which no other socket may share; a given one,
        a restart's, with SO_REUSEADDR past the last run's TIME_WAIT) as `listener`: taken while open."""
        self.close()
        sockets = bind("127.0.0.1", port, reuse_address=port != 0)
        self.port, self.listener = port_of(sockets), sockets[0]

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None


def parse_named(values: list[str], flag: str) -> list[tuple[str, Path]]:
    out = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ServeError(f"{flag} expects NAME=PATH, got {value!r}")
        if not (Path(path) / "config.json").is_file():
            raise ServeError(f"{flag} {name}: {path} has no config.json")
        out.append((name, Path(path)))
    return out


def source_digest(src: Path) -> str:
    """SHA-256 over the checkpoint folder's files (names and bytes): the quantized copy's cache key."""
    digest = hashlib.sha256()
    for f in sorted(p for p in src.iterdir() if p.is_file() and p.name != "train.log"):
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()


async def ensure_checkpoint(src: Path, folder: Path, log: Path) -> None:
    """Quantize the trained checkpoint `src` into `folder` (INT4 experts, FP8 KV scales) unless
    `folder` already holds the conversion of these exact bytes."""
    if not (src / "config.json").is_file():
        raise ServeError(f"the trained checkpoint {src} is missing (models/ in the repository)")
    digest = source_digest(src)
    stamp = folder / SOURCE_STAMP
    if stamp.is_file() and stamp.read_text().strip() == digest:
        return
    print(f"Converting {src.name} to INT4 experts + FP8 KV in {folder} (first start only)…", flush=True)
    staging = folder.with_name(f".{folder.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.cli", "quantize", "--src", str(src), "--dst", str(staging),
            "--weights", SERVED_WEIGHTS, "--kv-scales", stdout=out, stderr=out,
            env=child_environment({"OMP_NUM_THREADS": "1"}),
        )  # fmt: skip
        if await proc.wait() != 0:
            raise ServeError(f"could not convert {src} (see {log})")
    (staging / SOURCE_STAMP).write_text(digest + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)


async def start_backend(
    b: BackendProcess, dtype: str, device: str, logs: Path, parallel: tuple[str, ...] = ()
) -> None:
    """`parallel`: the `--tp/--ep/--dcp` arguments (each backend is a group of that many ranks).
    The backend serves on `b.listener` (bound now if it is not: OSError if `b.port` was taken
    meanwhile), which it holds from then on (kept in `b` if the process could not be started)."""
    if b.listener is None:
        b.reserve_port(b.port)
    listener, b.listener = b.listener, None
    assert listener is not None
    fd = listener.fileno()
    try:
        with (logs / f"{b.pool}.log").open("ab") as log:
            b.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway.cli", "backend", "--model", str(b.folder), "--port", str(b.port),
                "--listen-fd", str(fd), "--name", b.name, "--dtype", dtype, "--device", device,
                "--kv-dtype", b.kv_dtype, *parallel,
                "--data-dir", str(logs.parent),  # the data dir: its compile cache outlives restarts
                *(["--max-pages", str(b.max_pages)] if b.max_pages is not None else []),
                "--speculative", b.speculative,
                stdout=log, stderr=log, env=child_environment({"KUMO_BACKEND_SECRET": b.secret}),
                pass_fds=(fd,), preexec_fn=functools.partial(die_with_parent, os.getpid()),
                # its own process group: a terminal's Ctrl-C reaches `kumo serve` alone, which stops it (and
                # drains it) by SIGTERM, instead of interrupting it mid-request with a traceback in its log
                start_new_session=True,
            )  # fmt: skip
    except BaseException:
        b.listener = listener  # still held: for the next try, or closed by `run` (cancelled)
        raise
    listener.close()  # the backend's copy is the one that serves


async def wait_ready(backends: list[BackendProcess], logs: Path) -> None:
    """Poll each backend's `/v1/health` until all are `ok`; a backend that exits is an error."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + READY_TIMEOUT_S
    async with httpx.AsyncClient(timeout=2.0, trust_env=False) as http:
        pending = list(backends)
        while pending:
            for b in list(pending):
                assert b.process is not None
                if b.process.returncode is not None:
                    raise ServeError(
                        f"backend for {b.name} exited with {b.process.returncode} (see {logs / (b.pool + '.log')})"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    r = await http.get(f"{b.url}/v1/health")
                    if r.status_code == 200 and r.json().get("status") == "ok":
                        pending.remove(b)
            if loop.time() > deadline:
                raise ServeError("backends did not become ready in time")
            if pending:
                await asyncio.sleep(0.5)


async def stop_backends(backends: list[BackendProcess]) -> None:
    """SIGTERM every backend (each drains), then SIGKILL those still running after one shared
    `STOP_GRACE_S` (not one each: a stop with several hung backends takes no longer than with one)."""
    processes = [b.process for b in backends if b.process is not None]
    for process in processes:
        if process.returncode is None:
            process.terminate()
    waits = [asyncio.create_task(process.wait()) for process in processes]
    if waits:
        await asyncio.wait(waits, timeout=STOP_GRACE_S)
    for process, wait in zip(processes, waits, strict=True):
        if not wait.done():
            process.kill()
            await wait


def shares_latent_cache(folder: Path) -> bool:
    """Whether the checkpoint's attention is MLA (a `kv_lora_rank` latent cache that `--dcp` ranks
    can share by token); GQA models (GLM-4.5) have none, and their backends refuse `--dcp` > 1."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return True  # let the backend say what is wrong with the checkpoint
    return bool(config.get("text_config", config).get("kv_lora_rank"))


def parallel_flags(args: argparse.Namespace, folder: Path) -> tuple[str, ...]:
    """The `--tp/--ep/--dcp/--rank-timeout-s` flags of one backend: `--dcp` only where the checkpoint
    is MLA."""
    dcp = args.dcp if shares_latent_cache(folder) else 1
    return (
        "--tp",
        str(args.tp),
        "--ep",
        str(args.ep),
        "--dcp",
        str(dcp),
        "--rank-timeout-s",
        str(args.rank_timeout_s),
    )


def pages_for_window(src: Path) -> int:
    """KV pages for one request as long as the checkpoint's context window (config.json's
    `max_position_embeddings`), so a replica admits everything the catalog advertises. The nano
    models' FP8 KV takes 320 (Kimi) / 448 (GLM, with the indexer's keys) bytes a token: 84 / 87 MiB
    for 262,144 / 202,752 tokens."""
    try:
        config = json.loads((src / "config.json").read_text())
        window = int(config.get("text_config", config)["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ServeError(f"{src}/config.json has no usable max_position_embeddings ({exc})") from exc
    return -(-window // PAGE_SIZE)


def plan(
    args: argparse.Namespace, settings: GatewaySettings
) -> tuple[Catalog, list[BackendProcess], list[tuple[Path, Path]]]:
    """The catalog and one backend per served model; the (trained, served) checkpoint pairs to convert."""
    file = load_catalog_file(settings.catalog_file)
    to_create: list[tuple[Path, Path]] = []
    backends: list[BackendProcess] = []
    models: list[ModelSpec] = []
    models_dir: Path = args.models_dir or TRAINED
    for entry in file.models:
        trained = DEFAULT_MODELS.get(entry.pool)
        if trained is None:
            raise ServeError(f"the catalog's {entry.name} has no checkpoint kumo serve can create")
        if not (models_dir / trained / "config.json").is_file():
            raise ServeError(f"the trained checkpoint {models_dir / trained} is missing (no config.json)")
        folder = settings.data_dir / "checkpoints" / f"{trained}-{SERVED_WEIGHTS}"
        to_create.append((models_dir / trained, folder))
        backends.append(
            BackendProcess(
                entry.name, folder, entry.pool, 0, secrets.token_hex(24), kv_dtype=SERVED_KV,
                max_pages=pages_for_window(models_dir / trained),
            )
        )  # fmt: skip
    extra = [(n, p, "openai") for n, p in parse_named(args.model, "--model")]
    extra += [(n, p, "legacy") for n, p in parse_named(args.legacy_model, "--legacy-model")]
    for i, (name, folder, family) in enumerate(extra):
        pool = f"local-{i}"
        models.append(local_model_spec(name, folder, pool, family=family))
        backends.append(BackendProcess(name, folder, pool, 0, secrets.token_hex(24)))
    try:
        catalog = Catalog.from_file(file, models)
    except CatalogError as exc:
        raise ServeError(str(exc)) from exc
    return catalog, backends, to_create


def cannot_listen(settings: GatewaySettings, exc: OSError) -> ServeError:
    hint = (
        ': another server holds it? Choose another with --port N (make serve ARGS="--port N"), or 0 for any.'
        if in_use(exc) and settings.port
        else "."
    )
    return ServeError(f"cannot listen on {settings.host}:{settings.port} ({exc.strerror or exc}){hint}")


async def run(args: argparse.Namespace, settings: GatewaySettings) -> int:
    try:  # first, so a port in use fails now, and no backend's port can be this one
        sockets = bind(settings.host, settings.port)
    except OSError as exc:
        raise cannot_listen(settings, exc) from None
    backends: list[BackendProcess] = []
    try:
        catalog, backends, to_create = plan(args, settings)
        for b in backends:
            b.speculative = args.speculative
            b.reserve_port()  # (SO_REUSEADDR off: no socket can share it)
        return await _serve(args, settings, sockets, catalog, backends, to_create)
    finally:
        for b in backends:  # (those never started)
            b.close()
        for sock in sockets:  # (uvicorn closed them if it served)
            sock.close()


async def _serve(
    args: argparse.Namespace,
    settings: GatewaySettings,
    sockets: list[socket.socket],
    catalog: Catalog,
    backends: list[BackendProcess],
    to_create: list[tuple[Path, Path]],
) -> int:
    logs = settings.data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    logs.chmod(0o700)  # the owner's alone, as the data dir's other files (a traceback may quote a prompt)
    stop = asyncio.Event()
    supervisor: Supervisor | None = None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await asyncio.gather(
            *(ensure_checkpoint(src, dst, logs / "checkpoints.log") for src, dst in to_create)
        )
        for b in backends:
            group = parallel_flags(args, b.folder)
            if group[group.index("--dcp") + 1] != str(args.dcp):
                print(f"{b.name}: --dcp {args.dcp} applies to MLA models only; this one runs with --dcp 1")
            await start_backend(
                b,
                args.dtype or ("float32" if args.device == "cpu" else "bfloat16"),
                args.device,
                logs,
                group,
            )
        print(f"Starting {len(backends)} backend(s) (logs in {logs})…", flush=True)
        ready = asyncio.create_task(wait_ready(backends, logs))
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            return 130
        stopped.cancel()
        ready.result()
        pools = PoolsFile(pools={b.pool: PoolSpec(replicas=[b.url], secret=b.secret) for b in backends})
        services = await open_services(settings, catalog, pools)
        credentials = await ensure_dev_credentials(services.store, settings)
        dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")

        async def restart(b: Supervised) -> None:
            assert isinstance(b, BackendProcess)
            await start_backend(b, dtype, args.device, logs, parallel_flags(args, b.folder))

        def hold_port(b: Supervised) -> None:  # the moment it exited: its port, held through the backoff
            assert isinstance(b, BackendProcess)
            b.reserve_port(b.port)

        supervisor = Supervisor(backends, restart, on_exit=hold_port)
        supervisor.start()
        server = DrainingServer(
            uvicorn_config(create_app(settings, services), settings),
            services.lifecycle,
            settings.drain_timeout_s,
        )
        # uvicorn takes the signals while it serves and re-raises the one that stopped it after;
        # our handlers stay installed beneath, so that re-raise lands here, not in the default
        # action that would kill this process before it stops the backends
        try:
            listen(sockets, server.config.backlog)
        except OSError as exc:  # another server bound --port too (SO_REUSEADDR), and listened first
            raise cannot_listen(settings, exc) from None
        # a Ctrl-C since the backends were ready (opening the store, migrations) or before uvicorn's
        # own handlers are in: the server stops as soon as it runs, rather than the signal being lost
        stopping = asyncio.create_task(stop.wait())
        stopping.add_done_callback(lambda _: setattr(server, "should_exit", True))
        serving = asyncio.create_task(server.serve(sockets))
        try:
            while not server.started and not serving.done():
                await asyncio.sleep(0.05)
            if server.started and not stop.is_set():
                announce(settings, credentials, catalog, port_of(sockets))
            await serving
        finally:
            stopping.cancel()
        return 0
    finally:
        if supervisor is not None:
            await supervisor.stop()
        await stop_backends(backends)


def _reachable(host: str) -> str:
    """The host a client on this machine connects to: loopback for a wildcard, an IPv6 literal in
    brackets."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host.replace('%', '%25')}]" if ":" in host else host  # (a zone: fe80::1%eth0)


def announce(settings: GatewaySettings, credentials: DevCredentials, catalog: Catalog, port: int) -> None:
    """The block a user copies from: the URL (on `port`, the one bound: `--port 0` picks one),
    the development account and token, the admin token, and the shell lines that put them where
    `curl` and `kumo admin` look."""
    url = f"http://{_reachable(settings.host)}:{port}"
    models = ", ".join(m.name for m in catalog.models)
    admin = credentials.admin_token
    export_admin = f"    export KUMO_ADMIN_TOKEN={admin}\n" if admin is not None else ""
    if admin is None and settings.admin_token is not None:
        admin = "the value of KUMO_ADMIN_TOKEN"
    elif admin is None:  # chosen on an earlier start (its hash alone is stored): it still works
        admin = (
            "the one chosen earlier with KUMO_ADMIN_TOKEN (never written down; to replace it, start "
            "with KUMO_ADMIN_TOKEN set to a new one)"
        )
    kumo = Path(sys.executable).with_name("kumo")
    rule = "-" * 78
    # the README's example model: the first text-only one (the nano Kimi's replies, trained beside
    # its vision, are the weaker; its first answer to "Hello" was noise for a first-hour probe)
    example = next((m for m in catalog.models if not m.vision), catalog.models[0]).name
    print(
        f"\n{rule}\n"
        f"Kumo is ready at {url}  (models: {models}; catalog page {url}/models)\n\n"
        f"  Account ID: {credentials.account_id}\n"
        f"  Admin token: {admin}\n"
        f"  API token:  {credentials.api_token}\n\n"
        f"  Kept in {credentials_path(settings)} (owner-only): the same on every start with this\n"
        f"  data dir until revoked (a revoked token, or a deleted account, is replaced by a new one\n"
        f"  at the next start: export it again). In a shell:\n"
        f"    export ACCOUNT={credentials.account_id}\n"
        f"    export TOKEN={credentials.api_token}\n"
        f"    export KUMO_URL={url}\n"
        f"{export_admin}"
        f"    curl -s $KUMO_URL/client/v4/accounts/$ACCOUNT/ai/run/{example} \\\n"
        f'      -H "Authorization: Bearer $TOKEN" -d \'{{"prompt": "Hello"}}\'\n'
        f"    {kumo if kumo.is_file() else 'kumo'} admin tenants list   # also: tokens, quotas, models, usage\n"
        f"{rule}\n",
        flush=True,
    )


def _ranks(low: int) -> Callable[[str], int]:
    """A count of ranks from `low` to 64 (what a backend takes)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if not low <= value <= MAX_RANKS:
            raise argparse.ArgumentTypeError(f"must be {low} to {MAX_RANKS}, got {value}")
        return value

    return parse


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0:  # (NaN too)
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def _speculative(text: str) -> str:
    """`off` or `mtp:K`, checked as the backends check it (they get the text as given)."""
    try:
        parse_speculative(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--speculative ")) from None
    return text


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kumo serve", description="The gateway plus one CPU/GPU backend per model."
    )
    add_common_arguments(parser, default_port=DEFAULT_PORT)
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve a Kimi/GLM checkpoint (OpenAI-native family)",
    )
    parser.add_argument(
        "--legacy-model",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve a checkpoint with the legacy Workers AI family",
    )
    parser.add_argument(
        "--models-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"where the default models' trained checkpoints are ({', '.join(DEFAULT_MODELS.values())}; "
        "default: models/ in the repository), e.g. a retrained pair to try before committing it",
    )
    parser.add_argument("--device", default="cpu", help="where the backends run: cpu (default) or cuda[:N]")
    parser.add_argument("--tp", type=_ranks(1), default=1, help="ranks per backend, one process per device")
    parser.add_argument("--ep", type=_ranks(0), default=0, help="expert-parallel groups (default: = --tp)")
    parser.add_argument(
        "--dcp", type=_ranks(1), default=1, help="ranks sharing one MLA latent cache by token"
    )
    parser.add_argument(
        "--rank-timeout-s",
        type=_positive_seconds,
        default=120.0,
        help="with --tp: a rank silent this long fails its backend's group, which restarts",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="backend weights dtype (default: float32 on the CPU, bfloat16 on a GPU)",
    )
    parser.add_argument(
        "--speculative",
        type=_speculative,
        default="off",
        metavar="mtp:K",
        help="speculative decoding with the checkpoints' MTP layers, K = 1..3 drafts per step (default off)",
    )
    args = parser.parse_args(argv)
    for name in ("ep", "dcp"):  # checked here, not by each backend after the models are prepared
        size = getattr(args, name) or args.tp
        if args.tp % size:
            parser.error(f"--{name} ({size}) must divide --tp ({args.tp})")
    settings = settings_from(args)
    configure_logging(json=settings.log_json)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    try:
        return asyncio.run(run(args, settings))
    except (ServeError, CatalogError) as exc:
        print(f"kumo serve: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
