"""cursus.wire stays sans-IO: no sockets, event loop, clocks, threads or mutable globals."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from types import ModuleType

import pytest

import cursus.wire

BANNED_MODULES = ("asyncio", "socket", "time", "threading", "selectors")
IMPORT_LINE = re.compile(r"^\s*(?:import|from)\s+(" + "|".join(BANNED_MODULES) + r")\b", re.MULTILINE)


def wire_modules() -> list[ModuleType]:
    names = [f"cursus.wire.{info.name}" for info in pkgutil.iter_modules(cursus.wire.__path__)]
    return [cursus.wire, *(importlib.import_module(name) for name in sorted(names))]


def test_expected_modules_exist() -> None:
    names = {module.__name__.rsplit(".", 1)[-1] for module in wire_modules()}
    assert {"commands", "frame", "compression", "negotiation", "crq2", "batch", "errors", "responses"} <= names


@pytest.mark.parametrize("module", wire_modules(), ids=lambda m: m.__name__)
def test_no_io_imports(module: ModuleType) -> None:
    for banned in BANNED_MODULES:
        assert banned not in module.__dict__, f"{module.__name__} binds {banned}"
        value = module.__dict__.get(banned)
        assert not isinstance(value, ModuleType)
    for name, value in module.__dict__.items():
        if isinstance(value, ModuleType):
            assert value.__name__.split(".")[0] not in BANNED_MODULES, f"{module.__name__}.{name}"
    source = inspect.getsource(module)
    assert IMPORT_LINE.search(source) is None, f"{module.__name__} imports an I/O module"


@pytest.mark.parametrize("module", wire_modules(), ids=lambda m: m.__name__)
def test_no_module_level_mutable_globals(module: ModuleType) -> None:
    mutable = {
        name: type(value).__name__
        for name, value in module.__dict__.items()
        if not name.startswith("__") and isinstance(value, list | dict | set | bytearray)
    }
    assert mutable == {}
