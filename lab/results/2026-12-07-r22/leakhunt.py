"""Collect garbage after every test; record ResourceWarnings with the allocation traceback to a file."""

import gc
import os
import tracemalloc
import warnings

import pytest

LOG = os.environ.get("LEAK_LOG", "/tmp/leak/leaks.log")


def _collect(where):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
        gc.collect()
    hits = [w for w in caught if issubclass(w.category, ResourceWarning)]
    if hits:
        with open(LOG, "a") as f:
            for w in hits:
                f.write(f"== {where}: {w.message}\n")
                src = getattr(w, "source", None)
                if src is not None:
                    extra = getattr(src, "_extra", {}) or {}
                    proto = getattr(src, "_protocol", None)
                    loop = getattr(src, "_loop", None)
                    f.write(
                        f"   protocol={type(proto).__module__}.{type(proto).__qualname__} sock={extra.get('sockname')} peer={extra.get('peername')} loop_closed={getattr(loop, 'is_closed', lambda: None)()} server={getattr(src, '_server', None)!r}\n"
                    )
                    app = getattr(proto, "app", None)
                    if app is not None:
                        f.write(f"   app={app!r}\n")
                tb = tracemalloc.get_object_traceback(src) if src is not None else None
                if tb is not None:
                    for line in tb.format():
                        f.write("   " + line + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    _collect(item.nodeid)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    _collect("session end")
