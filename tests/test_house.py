"""The Python package's house rules (issue 36), read from its sources: imports at
module top, none of the root package, no private name borrowed from another
module, every exception in ``ckptio.errors``, nothing made at import. The layers
and the absence of import circles are import-linter's contract (pyproject.toml,
``lint-imports`` in the README's test command)."""

import ast
import os
import pathlib
import subprocess
import sys

import ckptio
import ckptio.errors
import ckptio.safetensors
import ckptio.staging

PACKAGE = pathlib.Path(ckptio.__file__).parent
MODULES = sorted(p for p in PACKAGE.rglob("*.py"))


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _is_submodule(name: str) -> bool:
    return (PACKAGE.parent / name.replace(".", "/")).with_suffix(".py").exists() or (
        PACKAGE.parent / name.replace(".", "/") / "__init__.py"
    ).exists()


def _imports(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ckptio"):
            yield node
        elif isinstance(node, ast.Import) and any(a.name.startswith("ckptio") for a in node.names):
            yield node


def test_the_package_has_its_layers():
    assert len(MODULES) > 30
    for folder in ("io", "formats", "loading", "tools"):
        assert (PACKAGE / folder / "__init__.py").exists(), folder


def test_imports_of_ckptio_are_at_module_top():
    inside = []
    for path in MODULES:
        tree = ast.parse(path.read_text())
        top = set(map(id, tree.body))
        for node in _imports(tree):
            if id(node) not in top:
                inside.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not inside, inside


def test_no_module_imports_the_root_package():
    """Only ``__init__`` may: below it, ``from ckptio import X`` names a module (the
    compiled ``_native`` included), never a name the root re-exports."""
    bad = []
    for path in MODULES:
        if path.name in ("__init__.py", "__main__.py") and path.parent == PACKAGE:
            continue
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                bad += [f"{path.name}: import {a.name}" for a in node.names if a.name == "ckptio"]
            elif node.module == "ckptio":
                for a in node.names:
                    if a.name != "_native" and not _is_submodule(f"ckptio.{a.name}"):
                        bad.append(f"{path.relative_to(PACKAGE)}: from ckptio import {a.name}")
    assert not bad, bad


def test_no_module_borrows_another_modules_private_names():
    """``from ckptio.x import _name`` and ``x._name`` of an imported ckptio module
    are refused (``_native`` is the extension: its public names are what it offers)."""
    bad = []
    for path in MODULES:
        tree = ast.parse(path.read_text())
        aliases: set[str] = set()
        for node in _imports(tree):
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if _is_submodule(full) or full == "ckptio._native":
                        aliases.add(a.asname or a.name)
                    elif a.name.startswith("_") and not a.name.startswith("__"):
                        bad.append(
                            f"{path.relative_to(PACKAGE)}: from {node.module} import {a.name}"
                        )
            else:
                aliases |= {a.asname or a.name.split(".")[0] for a in node.names}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                bad.append(
                    f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.value.id}.{node.attr}"
                )
    assert not bad, bad


def test_nothing_in_the_package_imports_the_benches():
    """benches/ (benchlib, the bench scripts) is on sys.path for the benches, probes and
    tests only: the wheel does not ship it."""
    benches = {p.stem for p in (pathlib.Path(__file__).parents[1] / "benches").glob("*.py")}
    assert "benchlib" in benches
    bad = []
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            where = path.relative_to(PACKAGE)
            bad += [f"{where}: {n}" for n in names if n.split(".")[0] in benches]
    assert not bad, bad


def test_every_exception_is_defined_in_errors():
    public = [
        obj
        for mod in (ckptio, ckptio.safetensors, ckptio.staging)
        for obj in vars(mod).values()
        if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__name__[0] != "_"
    ]
    assert len(public) >= 15
    native = [v for v in vars(ckptio._native).values() if isinstance(v, type)]
    for cls in public:
        if cls in native or not cls.__module__.startswith("ckptio"):
            continue  # the extension's own (re-exported by errors), or Python's
        assert getattr(ckptio.errors, cls.__name__, None) is cls, cls


def test_import_makes_nothing(tmp_path):
    """``import ckptio`` creates no folder: cuFile's log folder is made when cuFile
    first runs, not at import."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUFILE_", "XDG_"))}
    env["HOME"] = str(home)
    out = subprocess.run(
        [sys.executable, "-c", "import os, ckptio; print(os.environ['CUFILE_LOGFILE_PATH'])"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(home / ".cache" / "ckptio" / "cufile.log")
    assert not (home / ".cache").exists()
    assert sorted(os.listdir(tmp_path)) == ["home"]
