"""Stand-ins for the GPU kernel packages tokenspeed 0.1.1 imports at module level
(tokenspeed_kernel, tokenspeed_triton): the real wheels need CUDA 13, and the prefill
side that tests/test_tokenspeed*.py drive (its EPD manager, receiver and bootstrap
client) calls none of them. Installed into .venv-tokenspeed by scripts/setup_tokenspeed.sh,
where a .pth file imports this module: any import under those names then gets a module
whose every attribute is an inert stand-in. Nothing of this is in the worker.
"""
import importlib.abc
import importlib.machinery
import sys
import types

NAMES = ("tokenspeed_kernel", "tokenspeed_triton")


class Inert:
    """Answers anything: called, it returns a stand-in (or, used as a decorator, what it
    decorates); any attribute is another stand-in; false, zero and empty as a value."""

    def __init__(self, name="standin"):
        self._name = name

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], Inert):
            return args[0]
        return Inert(self._name + "()")

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Inert(f"{self._name}.{attr}")

    def __getitem__(self, key):
        return Inert(f"{self._name}[]")

    def __bool__(self):
        return False

    def __int__(self):
        return 0

    __index__ = __int__

    def __or__(self, other):
        return self

    __ror__ = __or__

    def __iter__(self):
        return iter(())

    def __mro_entries__(self, bases):
        return (object,)

    def __repr__(self):
        return f"<stand-in {self._name}>"


class StandinModule(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr == "CHUNK_SIZE":
            return 64
        return Inert(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in NAMES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = StandinModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.append(_Finder())
