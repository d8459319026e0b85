"""Test-only fault injection for the real `esd-worker` in a subprocess (tests/faults): put this
folder on its PYTHONPATH and the analysis of a model whose folder is named for a fault
misbehaves as a bad model would. Nothing in production code knows of it.

    crash-sigkill-*   the worker process is killed by SIGKILL (the kernel's OOM killer)
    crash-sigsegv-*   ... by SIGSEGV (a segfault in native code)
    hang-*            the analysis never returns and shows no progress
    leak-*            the analysis allocates 50 MB after 50 MB until something stops it

esd_worker.analysis.analyze.analyse_model is wrapped once that module is imported (an import
hook: the supervisor, which never imports it, stays torch-free).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import signal
import sys
import time
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any

TARGET = "esd_worker.analysis.analyze"


def _misbehave(name: str) -> None:
    if name.startswith("crash-sigkill"):
        os.kill(os.getpid(), signal.SIGKILL)
    elif name.startswith("crash-sigsegv"):
        os.kill(os.getpid(), signal.SIGSEGV)
    elif name.startswith("hang"):
        while True:
            time.sleep(3600)
    elif name.startswith("leak"):
        hoard = []
        while True:  # every page touched: resident, not just reserved
            hoard.append(bytearray(b"\x01") * (50 << 20))
            time.sleep(0.05)


def _wrap(module: ModuleType) -> None:
    original = module.analyse_model

    @functools.wraps(original)
    def analyse_model(settings: Any, **kwargs: Any) -> Any:
        _misbehave(Path(settings.model).name)
        return original(settings, **kwargs)

    module.analyse_model = analyse_model  # type: ignore[attr-defined]


class _WrapOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> ModuleSpec | None:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # the real spec, found by the finders after this one
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module: ModuleType) -> None:
            exec_module(module)
            _wrap(module)

        spec.loader.exec_module = exec_and_wrap  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _WrapOnImport())
