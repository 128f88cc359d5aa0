"""Cross-references in docstrings, comments and the docs name things that
exist: a module, class or function moved or renamed leaves no reference
to its old name behind.

What is checked:

- the Sphinx roles of the package's docstrings (``:mod:``, ``:class:``,
  ``:func:``, ``:meth:``, ``:attr:``, ``:data:``, ``:exc:``), resolved as
  Sphinx would from the module they are written in (``.live`` relative to
  its package, a bare name in the module, the class being documented or
  one of the module's classes, ``builtins``, or an importable module);
- dotted names ``replicator.<module>.<name>`` in the package's docstrings
  and comments, in the tests' and scripts' and in README.md and docs/;
- file names ``<name>.py`` (or ``<dir>/<name>.py``) in all of them: a file
  of the checkout ends so.
"""

import ast
import builtins
import functools
import importlib
import inspect
import io
import os
import re
import subprocess
import sys
import tokenize
from collections.abc import Iterator

from twisted.trial.unittest import SynchronousTestCase

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ROLE = re.compile(r":(?:mod|class|func|meth|attr|data|exc|obj):`([^`]+)`")
DOTTED = re.compile(r"(?<![\w.])replicator(?:\.[A-Za-z_][A-Za-z_0-9]*)+")
PYFILE = re.compile(r"(?<![\w./-])((?:[\w-]+/)*\w+\.py)\b")

_MISSING = object()
#: The last part of a dotted name that names a file, not a Python object.
FILE_SUFFIXES = {"conf", "target", "service", "yml", "yaml", "json", "toml", "cfg", "md",
                 "py", "txt", "jsonl", "sqlite"}


def tracked() -> list[str]:
    """The checkout's files (``git ls-files``), else every file under ROOT."""
    done = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode == 0:
        return done.stdout.split()
    return [os.path.relpath(os.path.join(d, n), ROOT) for d, _, names in os.walk(ROOT)
            for n in names]


def module_name(path: str) -> str:
    name = path[:-3].replace("/", ".")
    return name[:-len(".__init__")] if name.endswith(".__init__") else name


def texts(path: str, source: str) -> Iterator[tuple[int, str, str | None]]:
    """``(line, text, class name)`` of each docstring and comment of a module
    (the class whose docstring or method's docstring it is, if any)."""
    tree = ast.parse(source)

    def walk(node: ast.AST, cls: str | None) -> Iterator[tuple[int, str, str | None]]:
        # Docstrings are the first statement of a module, class or function
        # body; attribute docstrings follow an assignment.  Only statements
        # are walked (no expression holds a definition).
        body = getattr(node, "body", [])
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            for i, child in enumerate(body):
                if isinstance(child, ast.Expr) and isinstance(child.value, ast.Constant) \
                        and isinstance(child.value.value, str) \
                        and (i == 0 or isinstance(node, (ast.Module, ast.ClassDef))):
                    yield child.lineno, child.value.value, cls
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            for child in getattr(node, field, None) or []:
                if isinstance(child, ast.stmt) or isinstance(child, (ast.excepthandler,
                                                                     ast.match_case)):
                    inner = child.name if isinstance(child, ast.ClassDef) else cls
                    yield from walk(child, inner)

    yield from walk(tree, None)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string, None


def resolve_dotted(name: str) -> object:
    """The object ``name`` (``a.b.c``) names, importing modules as needed;
    ``_MISSING`` if there is none."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        return attributes(found, parts[cut:])
    return _MISSING


def attributes(found: object, parts: list[str]) -> object:
    for part in parts:
        found = attribute(found, part)
        if found is _MISSING:
            return _MISSING
    return found


def attribute(owner: object, name: str) -> object:
    """``owner.name``; for a class also an instance attribute (set as
    ``self.name``, annotated, or in ``__slots__``); for an interface one of
    its declared attributes and methods; for a package also a submodule."""
    value = getattr(owner, name, _MISSING)
    if value is not _MISSING:
        return value
    if hasattr(owner, "names") and hasattr(owner, "getBases"):  # a zope Interface
        return owner.get(name, _MISSING)
    if inspect.ismodule(owner) and hasattr(owner, "__path__"):
        try:
            return importlib.import_module(f"{owner.__name__}.{name}")
        except ImportError:
            return _MISSING
    if inspect.isclass(owner) and name in members(owner):
        return name  # an instance attribute
    return _MISSING


def target(text: str) -> str:
    """A role's target: ``Title <target>`` → target; ``~``, ``()`` dropped."""
    text = text.strip()
    m = re.search(r"<([^>]+)>$", text)
    if m:
        text = m.group(1)
    return text.lstrip("~!").removesuffix("()")


@functools.cache
def self_attributes(path: str | None) -> frozenset[str]:
    """The names set or read as ``self.name`` in the source file ``path``
    (a class's instance attributes are among its module's)."""
    if path is None or not path.endswith(".py"):
        return frozenset()
    with open(path, encoding="utf-8") as f:
        return frozenset(re.findall(r"\bself\.([A-Za-z_]\w*)", f.read()))


@functools.cache
def members(owner: object) -> frozenset[str]:
    """The names a module or class documents: its attributes; for a class
    also its instance attributes (``self.name``, annotations, slots); for an
    interface its declared attributes and methods."""
    names = set(dir(owner))
    if hasattr(owner, "names") and hasattr(owner, "getBases"):  # a zope Interface
        names |= set(owner.names(all=True))
    if inspect.isclass(owner):
        for klass in owner.__mro__:
            names |= set(getattr(klass, "__slots__", ()))
            names |= set(getattr(klass, "__annotations__", {}))
            names |= self_attributes(getattr(sys.modules.get(klass.__module__), "__file__", None))
    return frozenset(names)


_index: set[str] | None = None


def index() -> set[str]:
    """Every qualified name in the package: modules, what each defines or
    imports at its top, the members of its classes and interfaces."""
    global _index
    if _index is None:
        _index = set()
        for path in tracked():
            if not (path.startswith("replicator/") and path.endswith(".py")):
                continue
            name = module_name(path)
            module = importlib.import_module(name)
            _index.add(name)
            for key, value in vars(module).items():
                _index.add(f"{name}.{key}")
                if (inspect.isclass(value) or hasattr(value, "names")) \
                        and getattr(value, "__module__", None) == name:
                    _index |= {f"{name}.{key}.{m}" for m in members(value)}
    return _index


def resolve_role(name: str, module: object, cls: str | None) -> bool:
    """Whether a role's ``name``, written in ``module`` (in the docstring of
    class ``cls`` or one of its methods), names something, as Sphinx finds
    it: ``.a.b`` any object whose name ends so (or relative to the module's
    package); ``a.b`` in the module, the documented class, builtins, or as a
    full name."""
    modname = module.__name__
    if name.startswith("."):
        level = len(name) - len(name.lstrip("."))
        rest = name.lstrip(".")
        package = modname if hasattr(module, "__path__") else modname.rpartition(".")[0]
        base = package.rsplit(".", level - 1)[0] if level > 1 else package
        if resolve_dotted(f"{base}.{rest}") is not _MISSING:
            return True
        return any(n.endswith("." + rest) for n in index())
    first, *rest = name.split(".")
    scopes: list[object] = [module]
    if cls is not None and getattr(module, cls, None) is not None:
        scopes.append(getattr(module, cls))
    scopes += [v for v in vars(module).values()
               if inspect.isclass(v) and v.__module__ == modname]
    scopes.append(builtins)
    for scope in scopes:
        if first in members(scope):
            found = attribute(scope, first)
            if not rest or attributes(found, rest) is not _MISSING \
                    or rest[-1] in members(attributes(found, rest[:-1])):
                return True
    return resolve_dotted(name) is not _MISSING or name in index()


def file_exists(name: str, files: set[str]) -> bool:
    return name in files or any(f.endswith("/" + name) for f in files)


def broken(paths: list[str] | None = None) -> list[str]:
    """Every broken reference, as ``path:line: reference``."""
    files = set(tracked())
    paths = sorted(files) if paths is None else paths
    found: list[str] = []
    for path in paths:
        if path.endswith(".py") and path.startswith(("replicator/", "tests/", "scripts/")):
            with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                source = f.read()
            in_package = path.startswith("replicator/")
            module = importlib.import_module(module_name(path)) if in_package else None
            for line, text, cls in texts(path, source):
                if module is not None:
                    for m in ROLE.finditer(text):
                        if not resolve_role(target(m.group(1)), module, cls):
                            found.append(f"{path}:{line}: {m.group(0)}")
                found += check_text(path, line, text, files)
        elif path.endswith(".md") and (path == "README.md" or path.startswith("docs/")):
            with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                for line, text in enumerate(f, 1):
                    found += check_text(path, line, text, files)
    return found


def check_text(path: str, line: int, text: str, files: set[str]) -> list[str]:
    out = []
    for m in DOTTED.finditer(text):
        if m.group(0).rpartition(".")[2] in FILE_SUFFIXES:
            continue  # a file's name (replicator.conf, replicator.rules.yml)
        if resolve_dotted(m.group(0)) is _MISSING:
            out.append(f"{path}:{line}: {m.group(0)}")
    for m in PYFILE.finditer(text):
        if m.group(1).startswith("synapse/"):
            continue  # a file of Synapse's tree
        if not file_exists(m.group(1), files):
            out.append(f"{path}:{line}: {m.group(1)}")
    return out


class ReferenceTests(SynchronousTestCase):
    def test_none_broken(self):
        self.assertEqual(broken(), [])

    def test_a_broken_one_is_found(self):
        """Each kind of reference, once named right and once wrong."""
        import replicator.http.read.sse as sse
        self.assertTrue(resolve_role(".live", sse, None))
        self.assertTrue(resolve_role("..answers.HttpError", sse, None))
        self.assertTrue(resolve_role("SseClient.start", sse, None))
        self.assertTrue(resolve_role("start", sse, "SseClient"))
        self.assertTrue(resolve_role("position", sse, "SseClient"))  # self.position
        self.assertTrue(resolve_role("WRITE_SIZE", sse, None))
        self.assertTrue(resolve_role("twisted.internet.defer.Deferred", sse, None))
        self.assertTrue(resolve_role("ValueError", sse, None))
        self.assertIsNot(resolve_dotted(
            "replicator.replication.interfaces.IReplicationHandler.lost_connection"), _MISSING)
        self.assertIs(resolve_dotted(
            "replicator.replication.interfaces.IReplicationHandler.nope"), _MISSING)
        for wrong in (".gone", "..answers.Nope", "SseClient.nope", "Nope", "twisted.nope"):
            self.assertFalse(resolve_role(wrong, sse, None), wrong)
        files = {"replicator/http/read/sse.py", "README.md"}
        self.assertEqual(check_text("x", 1, "see ``replicator.http.read.sse.SseClient``, "
                                    "read/sse.py and sse.py", files), [])
        self.assertEqual(check_text("x", 1, "``replicator.http.sse`` or http/sse.py, "
                                    "replicator.http.read.sse.Gone", files),
                         ["x:1: replicator.http.sse", "x:1: replicator.http.read.sse.Gone",
                          "x:1: http/sse.py"])
