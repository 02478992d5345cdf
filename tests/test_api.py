"""The public surface of ``hf_dynaquant``: every exported name resolves, every error a user may
catch is exported, and the layers import only downward (errors -> core -> codecs -> store ->
search -> training / pretrained -> integrations -> cli / demo), never from the package root."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import hf_dynaquant
from hf_dynaquant import errors

PACKAGE = Path(hf_dynaquant.__file__).parent

# bottom to top; a module may import from its own layer and those below
LAYERS = {
    "_version": 0,
    "errors": 0,
    "renames": 0,
    "core": 1,
    "codecs": 2,
    "store": 3,
    "pipeline": 3,
    "search": 4,
    "training": 5,
    "pretrained": 5,
    "integrations": 6,
    "inspection": 7,
    "cli": 7,
    "demo": 7,
}


@pytest.mark.parametrize("name", hf_dynaquant.__all__)
def test_every_exported_name_resolves(name: str) -> None:
    assert getattr(hf_dynaquant, name) is not None


def test_every_public_error_is_exported() -> None:
    public = {
        name
        for name, obj in vars(errors).items()
        if inspect.isclass(obj)
        and not name.startswith("_")
        and obj.__module__ == errors.__name__
        and (issubclass(obj, errors.DynaQuantError) or issubclass(obj, Warning))
    }
    assert public <= set(hf_dynaquant.__all__), sorted(public - set(hf_dynaquant.__all__))
    assert all(getattr(hf_dynaquant, name) is getattr(errors, name) for name in public)


def test_materialize_is_the_checkpoint_one() -> None:
    assert hf_dynaquant.materialize is hf_dynaquant.materialize_checkpoint


def _imports() -> list[tuple[str, str, str, int]]:
    """``(importing module, imported module, imported name, line)`` of every relative import."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        package = parts if parts[-1] == "__init__" else parts[:-1]
        package = [p for p in package if p != "__init__"]
        module = ".".join(p for p in parts if p != "__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                out += [(module, target, alias.name, node.lineno) for alias in node.names]
    return out


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_no_upward_or_root_imports() -> None:
    bad = []
    for module, target, name, line in _imports():
        if module == "hf_dynaquant":
            continue  # the package root may import anything
        submodule = (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file()
        if target == "hf_dynaquant" and not submodule:
            bad.append(f"{module}:{line} imports {name} from the package root (which imports every layer)")
        mine, theirs = _layer(module), _layer(f"{target}.{name}" if target == "hf_dynaquant" else target)
        if mine is not None and theirs is not None and theirs > mine:
            bad.append(f"{module}:{line} imports {target}.{name} from a layer above")
    assert not bad, "\n".join(bad)


def test_no_private_name_is_imported_across_modules() -> None:
    bad = [
        f"{module}:{line} imports {name} from {target}"
        for module, target, name, line in _imports()
        if name.startswith("_") and not name.startswith("__")
        # the one private module: the compiled kernels, loaded by their own loader
        and not (module == "hf_dynaquant.core.kernels" and name == "_kernels")
    ]
    assert not bad, "\n".join(bad)


def test_no_import_cycles() -> None:
    """Between the package's modules (the package root, which imports everything, left out),
    counting imports inside functions too."""
    graph: dict[str, set[str]] = {}
    for module, target, name, _ in _imports():
        if module == "hf_dynaquant":
            continue
        dotted = f"{target}.{name}"
        is_module = (PACKAGE.parent / Path(*dotted.split("."))).with_suffix(".py").is_file() or (
            PACKAGE.parent / Path(*dotted.split("."))
        ).is_dir()
        imported = dotted if is_module else target
        if imported != "hf_dynaquant" and imported != module:
            graph.setdefault(module, set()).add(imported)
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            cycle = path[path.index(node) :] + [node]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, [*path, node])
        done.add(node)

    for start in sorted(graph):
        visit(start, [])
