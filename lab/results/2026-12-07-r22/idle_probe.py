"""An idle `kumo backend --tp 2 --rank-timeout-s 3`: before 9285d23 its rank 1 timed out and the group went down."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository
from tests.backend.server.test_ranks_server import Backend, _generate
from tests.backend.server_checkpoints import make_served_checkpoint

tmp = Path("/tmp/idle/w")
tmp.mkdir(parents=True, exist_ok=True)
b = Backend(make_served_checkpoint("deepseek_v3", tmp / "ds"), tmp, "--tp", "2", "--rank-timeout-s", "3")
try:
    print("healthy; idle 10 s", flush=True)
    time.sleep(10)
    print("alive:", b.process.poll() is None, flush=True)
    ev = _generate(b.url, "after-idle", "a long story")
    print("events:", ev[-1] if ev else ev, flush=True)
finally:
    b.stop()
    print(b.log.read_text()[-3000:])
