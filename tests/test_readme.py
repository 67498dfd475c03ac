"""The README's examples run as written: its code is read from README.md, so it cannot
drift from what ckptio does.

- Every ```python block runs, in order, in one fresh process in an empty folder
  (torch.distributed not initialised: DCP runs as a single process).
- Every line of a ```sh block that starts with ``ckptio`` runs as ``python -m ckptio``
  at its place between them, and must exit 0; ``ckptio bench`` (a minute of disk
  traffic) only has its arguments checked.
- The test command of "Set-up: two commands" is what CI (.ci/run) runs, verbatim, and
  the README's links to files of the repository lead somewhere.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import ckptio
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)


def blocks(lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(README) if kind == lang]


def script() -> str:
    """The README's python blocks and ckptio commands as one Python program."""
    parts = ["import subprocess as _sp, sys as _sys, shlex as _shlex\n"]
    for kind, body in FENCE.findall(README):
        if kind == "python":
            parts.append(body)
        elif kind == "sh":
            for line in body.splitlines():
                argv = shlex.split(line, comments=True)
                if not argv or argv[0] != "ckptio":
                    continue
                if argv[1:2] == ["bench"]:
                    argv.append("--help")  # parse the arguments, measure nothing
                parts.append(
                    f"_r = _sp.run([_sys.executable, '-m', *{argv!r}], capture_output=True, "
                    "text=True)\n"
                    f"assert _r.returncode == 0, ({line.strip()!r}, _r.stdout, _r.stderr)\n"
                    "print(_r.stdout)\n"
                )
    return "\n".join(parts)


def test_the_readme_has_examples():
    assert len(blocks("python")) >= 4
    assert sum(line.startswith("ckptio ") for b in blocks("sh") for line in b.splitlines()) >= 4


@pytest.mark.slow
def test_readme_examples_run(tmp_path, s3):
    pytest.importorskip("lightning")  # the README's Lightning block (a test extra)
    # The object-store block runs against the test server: its bucket, its variables.
    (tmp_path / "readme_examples.py").write_text(
        script().replace("s3://bucket/", s3.url("readme") + "/")
    )
    env = dict(os.environ, **s3.env)
    # The ckptio under test, also for the `python -m ckptio` commands.
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(ckptio.__file__).parents[1]), env.get("PYTHONPATH", "")]
    )
    r = subprocess.run(
        [sys.executable, "readme_examples.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert ": ok: " in r.stdout  # verify's summary was printed
    for made in ("ckpt.pt", "model.safetensors", "sharded", "dcp_ckpt", "model.pt", "local_ckpts"):
        assert (tmp_path / made).exists(), made


def test_ci_runs_the_readme_test_command_verbatim():
    setup = README.split("## Set-up: two commands", 1)[1].split("\n## ", 1)[0]
    commands = FENCE.findall(setup)
    assert len(commands) == 2, "the set-up section holds the two commands"
    bench, tests = (body.strip() for _, body in commands)
    assert bench.endswith("ckptio bench")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci, "CI must run the README's test command verbatim"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_of_the_readme_and_docs_lead_somewhere():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text):
            if "://" in target:
                continue
            path = (doc.parent / target).resolve() if target else doc
            assert path.exists(), (doc.name, target)
            if anchor:
                headings = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
                assert anchor in {_slug(h) for h in headings}, (doc.name, target, anchor)
        for path in re.findall(
            r"`((?:tests|benches|probes|scripts|examples|docs|src|python)/[\w./-]+)`", text
        ):
            if "*" not in path and not path.endswith("/"):
                assert (ROOT / path).exists(), (doc.name, path)


def test_tuning_names_every_ckptio_variable():
    """docs/tuning.md has every CKPTIO_* variable the code, tests and benches read."""
    names = set()
    for folder in ("src", "python", "tests", "benches", "probes", "scripts"):
        for f in (ROOT / folder).rglob("*"):
            if f.suffix in (".rs", ".py", ".sh") and f.is_file():
                names |= set(re.findall(r"\bCKPTIO_[A-Z0-9_]+\b", f.read_text()))
    tuning = (ROOT / "docs" / "tuning.md").read_text()
    missing = sorted(n for n in names if f"`{n}`" not in tuning)
    assert not missing, f"document in docs/tuning.md: {missing}"
