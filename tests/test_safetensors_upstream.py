"""safetensors' own Python tests, run twice: against safetensors, and with
``safetensors.torch``'s functions pointing at ``ckptio.safetensors``.

The source package of the installed safetensors version is downloaded from PyPI at test
time (``pip download --no-binary``; nothing of it lives in this repo). Every test whose
outcome differs between the two runs must be listed, with its reason, in
``tests/upstream/safetensors_allowlist.txt``; any other difference fails. Where the
download cannot be made, the test says so and is skipped (never a silent pass).
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytest.importorskip("safetensors")
HERE = Path(__file__).parent
ALLOW = HERE / "upstream" / "safetensors_allowlist.txt"
RUN_TIMEOUT = 600


def allowlist() -> dict[str, tuple[str, str, str]]:
    """test id -> (outcome with safetensors, outcome with ckptio, reason)."""
    out = {}
    for line in ALLOW.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        test, _, rest = line.partition(": ")
        change, _, reason = rest.partition(": ")
        base, _, ours = change.partition(" -> ")
        assert test and base and ours and reason.strip(), f"malformed allow-list line: {line}"
        out[test.strip()] = (base.strip(), ours.strip(), reason.strip())
    return out


def download(version: str, dest: Path) -> Path:
    """The source package of safetensors ``version``, or a skip saying why not."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "safetensors",
        "--disable-pip-version-check", "-d", str(dest), f"safetensors=={version}",
    ]  # fmt: skip
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (subprocess.TimeoutExpired, OSError) as e:
        pytest.skip(f"could not download safetensors {version}'s source package: {e}")
    found = sorted(dest.glob("safetensors-*.tar.gz"))
    if r.returncode != 0 or not found:
        tail = (r.stderr or r.stdout).strip().splitlines()[-2:]
        pytest.skip(f"could not download safetensors {version}'s source package: {tail}")
    return found[0]


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    version = importlib.metadata.version("safetensors")
    return download(version, tmp_path_factory.mktemp("sdist"))


def test_a_failed_download_is_a_skip_that_says_so(tmp_path):
    with pytest.raises(pytest.skip.Exception, match="could not download safetensors 0.0.0a0"):
        download("0.0.0a0", tmp_path)


def run_suite(archive: Path, where: Path, patched: bool) -> dict[str, tuple[str, str]]:
    """Outcome (and message) of every test of the package's Python suite."""
    with tarfile.open(archive) as t:
        t.extractall(where, filter="data")
    (root,) = where.iterdir()
    pkg = root / "bindings" / "python"
    report = where / "report.xml"
    env = dict(os.environ)
    # the suite runs in its own folder: this checkout's paths made absolute
    paths = [str(HERE / "upstream")] if patched else []
    paths += [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        "--continue-on-collection-errors",
        f"--junitxml={report}",
        "--rootdir",
        str(pkg),
        "tests",
    ]
    if patched:
        cmd[3:3] = ["-p", "st_ckptio_plugin"]
    r = subprocess.run(cmd, cwd=pkg, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    if not report.exists():
        raise AssertionError(f"the suite did not run ({r.returncode}):\n{r.stdout[-3000:]}")
    out = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        state, msg = "passed", ""
        for kind in ("failure", "error", "skipped"):
            el = case.find(kind)
            if el is not None:
                state = {"failure": "failed"}.get(kind, kind)
                msg = (el.get("message") or "")[:300]
        out[test] = (state, msg)
    return out


def test_safetensors_own_suite_passes_with_ckptio(sdist, tmp_path):
    base = run_suite(sdist, tmp_path / "safetensors", patched=False)
    ours = run_suite(sdist, tmp_path / "ckptio", patched=True)
    ran = [t for t, (s, _) in base.items() if s == "passed"]
    assert len(ran) >= 20, f"safetensors' suite ran only {len(ran)} tests: {base}"
    allowed = allowlist()
    bad = []
    for test in sorted(set(base) | set(ours)):
        b, o = base.get(test, ("absent", ""))[0], ours.get(test, ("absent", ""))
        if b == o[0]:
            continue
        if allowed.get(test, ("", "", ""))[:2] == (b, o[0]):
            continue
        bad.append(f"{test}: {b} -> {o[0]}: {o[1]}")
    stale = [t for t in allowed if t in base and base[t][0] == ours.get(t, ("absent",))[0]]
    print(
        f"safetensors suite: {len(ran)} passed with safetensors, "
        f"{sum(s == 'passed' for s, _ in ours.values())} with ckptio; "
        f"{len(allowed) - len(stale)} allowed differences; stale entries: {stale}"
    )
    assert not bad, "differences not in the allow-list:\n" + "\n".join(bad)
