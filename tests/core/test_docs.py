"""The docs hold to the repository (issue 37, finding 8): every relative link leads somewhere (a
file, and the heading when it names one), and every install line names a source pip can reach
on a bare box: the package is not on PyPI, so `pip install train-supervisor` fails there. The
archive form the recipes use installs with its package data (the default config, the mails)."""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def markdown_files() -> list[Path]:
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "examples").rglob("*.md"))]
    return [f for f in files if f.exists()]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def anchors(md: Path) -> set[str]:
    text = FENCE.sub("", md.read_text(encoding="utf-8"))
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M)}


def relative_links(md: Path) -> list[str]:
    text = FENCE.sub("", md.read_text(encoding="utf-8"))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_leads_somewhere(md: Path):
    broken = []
    for link in relative_links(md):
        path, _, anchor = link.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            broken.append(f"{link}: no {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{link}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{md.relative_to(REPO)}: " + "; ".join(broken)


def test_the_link_check_sees_a_broken_link(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("# Top\nsee [a](missing.md), [b](#top), [c](#nowhere) and [d](https://example.com)\n")
    assert relative_links(md) == ["missing.md", "#top", "#nowhere"]
    assert anchors(md) == {"top"}
    assert slug("How it is built") == "how-it-is-built" and slug("`stop` and `run`: why") == "stop-and-run-why"


BARE = re.compile(r"pip3? install (?:-\S+ )*['\"]?train-supervisor(?:['\"\s\[]|$)", re.M)


def install_sources() -> list[Path]:
    return [*markdown_files(), *sorted((REPO / "examples" / "recipes").iterdir())]


def test_no_install_line_names_a_package_the_index_does_not_have():
    found = [f"{f.relative_to(REPO)}: {m.group(0).strip()}" for f in install_sources()
             for m in BARE.finditer(f.read_text(encoding="utf-8"))]
    assert not found, "train-supervisor is not on PyPI; install from the archive or a clone: " + "; ".join(found)
    assert BARE.search("  - pip install -q train-supervisor\n") and not BARE.search('pip install "$TS_ARCHIVE"')


def test_the_archive_installs_with_its_package_data(tmp_path):
    """What `pip install <archive>.tar.gz` gets: the tracked files as GitHub's archive packs them."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    names = [n for n in tracked.decode().split("\0") if n and (REPO / n).is_file()]
    archive = tmp_path / "train-supervisor-main.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for n in names:
            tar.add(REPO / n, arcname=f"train-supervisor-main/{n}")
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--no-index", "--target", str(target), str(archive)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (target / "supervisor" / "default-config.toml").is_file()
    assert (target / "bin" / "supervisorctl").is_file() and (target / "bin" / "train-supervisord").is_file()
    r = subprocess.run([sys.executable, "-c", "import supervisor; from supervisor.cli.configdoc import default_text; "
                        "print(supervisor.__file__); print(len(default_text()))"], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    where, size = r.stdout.split()
    assert where.startswith(str(target)) and int(size) > 1000, r.stdout
