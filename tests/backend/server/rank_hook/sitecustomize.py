"""Test-only: the folder of this file, put first on a `kumo backend --tp N`'s PYTHONPATH by
`tests.backend.server.rank_probe.environment`, makes Python run this at start-up in that backend
(rank 0) and in every rank it starts. Nothing in the product reads it; a process started without
this folder on its path never sees it."""

import sys

if sys.orig_argv[1:4] == ["-m", "gateway.cli", "backend"]:
    from tests.backend.server.rank_probe import install

    install(rank=0)
elif sys.orig_argv[-2:] == ["-m", "backend.server.rank_group"]:
    from tests.backend.server.rank_probe import install

    install(rank=None)  # a rank > 0: which one, it learns when it joins the group
