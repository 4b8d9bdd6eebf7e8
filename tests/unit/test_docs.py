"""The docs hold what they say: README.md, docs/**/*.md and analysis/README.md.

- Links: every relative link (`[text](path)`, `[text](path#anchor)`, `[text](#anchor)`)
  names a file or folder of the repository, and an anchor names a heading of its page
  (GitHub's anchors: lower case, punctuation dropped, spaces as hyphens, `-1`, `-2` … for
  repeats). Links inside code blocks and code spans are not links.
- Runnable blocks: a fenced block whose info string is `bash runnable` runs, as written,
  under `bash -e -o pipefail`, in a scratch directory holding links to the repository's
  files (`configs/…` resolves, `runs/…` lands in the scratch directory), with `pivot-hpc`
  and `python` being this interpreter; it must exit 0 within RUNNABLE_TIMEOUT_S.
  `bash runnable slow` marks a block of more than a few seconds (pytest's `slow` marker).
- Every `pivot-hpc VERB` (and `pivot-hpc bench NAME`) in a bash block names a real command.
- The resume keys the README and the Slurm-and-resume guide list are `RESUMABLE_KEYS`.
- Code comments that cite `DESIGN.md §N` cite a section docs/design.md has; `PLATFORM.md`
  is docs/platform.md.
- The README stays a front door (at most README_MAX_LINES lines).

The conventions are documented for writers in docs/README.md ("Conventions").
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pivot_hpc.checkpoint.store import RESUMABLE_KEYS
from pivot_hpc.cli.bench import BENCHES
from pivot_hpc.cli.main import COMMANDS

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 200
RUNNABLE_TIMEOUT_S = 120


def doc_files() -> list[Path]:
    docs = sorted((REPO / "docs").rglob("*.md"))
    return [REPO / "README.md", REPO / "analysis" / "README.md", *docs]


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


# ---------------------------------------------------------------- markdown parsing

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")


def split_fences(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str, str]]]:
    """(prose lines as (line number, text), code blocks as (first line, info, body))."""
    prose: list[tuple[int, str]] = []
    blocks: list[tuple[int, str, str]] = []
    fence = None
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None:
            if m:
                fence, info, start, body = m.group(1), m.group(2).strip(), n, []
            else:
                prose.append((n, line))
        elif (
            m
            and m.group(1)[0] == fence[0]
            and len(m.group(1)) >= len(fence)
            and not m.group(2).strip()
        ):
            blocks.append((start, info, "\n".join(body) + "\n"))
            fence = None
        else:
            body.append(line)
    assert fence is None, f"unclosed code fence opened at line {start}"
    return prose, blocks


CODE_SPAN = re.compile(r"(`+)(?:.+?)\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$")


def links(path: Path) -> list[tuple[int, str]]:
    prose, _ = split_fences(path.read_text())
    # a link's text may hold code spans; a code span never holds a link
    return [
        (n, m.group(1))
        for n, line in prose
        for m in LINK.finditer(CODE_SPAN.sub(lambda s: "x" * len(s.group(0)), line))
    ]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links → their text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose, _ = split_fences(path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose:
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(1))
        k = seen.get(base, 0)
        seen[base] = k + 1
        out.add(base if k == 0 else f"{base}-{k}")
    return out


def test_slug_is_githubs() -> None:
    assert (
        slug("7. Planner, monitor, executor (§7, App. D)") == "7-planner-monitor-executor-7-app-d"
    )
    assert slug("`pivot-hpc plan`: will it fit, before anything starts") == (
        "pivot-hpc-plan-will-it-fit-before-anything-starts"
    )
    assert slug("9a. Multi-turn rollouts and tools") == "9a-multi-turn-rollouts-and-tools"


# ---------------------------------------------------------------- links


@pytest.mark.parametrize("doc", doc_files(), ids=rel)
def test_every_relative_link_resolves(doc: Path) -> None:
    broken = []
    for n, target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: …
            continue
        path_part, _, anchor = target.partition("#")
        dest = (doc.parent / path_part).resolve() if path_part else doc
        where = f"{rel(doc)}:{n}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file)")
        elif REPO not in (dest, *dest.parents):
            broken.append(f"{where} (outside the repository)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{where} (no heading with that anchor in {rel(dest)})")
    assert not broken, "\n".join(broken)


def test_the_docs_tree_is_linked_from_its_index() -> None:
    index = {
        (REPO / "docs" / t.partition("#")[0]).resolve()
        for _, t in links(REPO / "docs" / "README.md")
    }
    pages = [p for p in (REPO / "docs").rglob("*.md") if p.parent.name != "results"]
    results = (REPO / "docs" / "results" / "README.md").resolve()
    reports = {(results.parent / t).resolve() for _, t in links(results) if "#" not in t}
    missing = [rel(p) for p in pages if p.resolve() not in index and p.name != "README.md"]
    missing += [
        rel(p)
        for p in (REPO / "docs" / "results").glob("*.md")
        if p.name != "README.md" and p.resolve() not in reports
    ]
    # docs/guide/vllm.md is written alongside; the guide names it until it is linked
    missing = [m for m in missing if m != "docs/guide/vllm.md"]
    assert not missing, f"pages no index links to: {missing}"


# ---------------------------------------------------------------- commands


def code_blocks(kind: str) -> list[tuple[Path, int, str, str]]:
    out = []
    for doc in doc_files():
        for start, info, body in split_fences(doc.read_text())[1]:
            words = info.split()
            if words and words[0] == kind:
                out.append((doc, start, " ".join(words[1:]), body))
    return out


def runnable_blocks() -> list:
    params = []
    for doc, start, flags, body in code_blocks("bash"):
        if "runnable" not in flags.split():
            continue
        marks = [pytest.mark.slow] if "slow" in flags.split() else []
        params.append(pytest.param(body, id=f"{rel(doc)}:{start}", marks=marks))
    return params


def test_there_are_runnable_blocks() -> None:
    files = {p.id.split(":")[0] for p in runnable_blocks()}
    assert "README.md" in files and len(runnable_blocks()) >= 4, files


@pytest.fixture
def scratch(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A directory that looks like the repository (links to its files) and an environment
    whose `pivot-hpc` and `python` are this interpreter."""
    work = tmp_path / "work"
    work.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in {".git", "runs"}:
            (work / entry.name).symlink_to(entry)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, cmd in {
        "pivot-hpc": f'exec "{sys.executable}" -m pivot_hpc "$@"',
        "python": f'exec "{sys.executable}" "$@"',
        "python3": f'exec "{sys.executable}" "$@"',
    }.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{cmd}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    env["MPLBACKEND"] = "Agg"
    return work, env


@pytest.mark.parametrize("block", runnable_blocks())
def test_runnable_block_runs(block: str, scratch: tuple[Path, dict[str, str]]) -> None:
    work, env = scratch
    try:
        done = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", block],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=RUNNABLE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"did not finish in {RUNNABLE_TIMEOUT_S} s:\n{block}")
    assert done.returncode == 0, (
        f"exit {done.returncode}:\n{block}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    )


def test_every_pivot_hpc_command_in_the_docs_exists() -> None:
    wrong = []
    for doc, start, _, body in code_blocks("bash"):
        for k, line in enumerate(body.splitlines()):
            line = line.split("#", 1)[0]
            for m in re.finditer(
                r"(?:^|[\s;&|(])pivot-hpc\s+([A-Za-z][\w-]*)(?:\s+([a-z][\w-]*))?", line
            ):
                verb, sub = m.group(1), m.group(2)
                if verb not in COMMANDS:
                    wrong.append(f"{rel(doc)}:{start + 1 + k}: pivot-hpc {verb}")
                elif verb == "bench" and sub not in BENCHES:
                    wrong.append(f"{rel(doc)}:{start + 1 + k}: pivot-hpc bench {sub}")
    assert not wrong, "\n".join(wrong)


# ---------------------------------------------------------------- facts the docs repeat


@pytest.mark.parametrize("doc", ["README.md", "docs/guide/slurm-and-resume.md"])
def test_the_resume_keys_listed_are_the_codes(doc: str) -> None:
    text = (REPO / doc).read_text()
    keys = [k + "*" if k.endswith(".") else k for k in RESUMABLE_KEYS]
    missing = [k for k in keys if f"`{k}`" not in text]
    assert not missing, f"{doc} does not list these resumable keys: {missing}"


def test_readme_stays_a_front_door() -> None:
    n = len((REPO / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines: move details into docs/"


CITATION = re.compile(r"(?:DESIGN\.md|docs/design\.md) §(\d+[a-z]?)(?:[–-]§(\d+[a-z]?))?")


def test_design_citations_name_sections_of_docs_design() -> None:
    design = (REPO / "docs" / "design.md").read_text()
    sections = set(re.findall(r"^## (\w+)\. ", design, re.M))
    assert (REPO / "docs" / "platform.md").is_file()
    wrong = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in {"runs", "__pycache__"}]
        for name in files:
            path = Path(root) / name
            if path.suffix not in {".py", ".sh", ".sbatch", ".cfg", ".md", ".yaml", ".toml"}:
                continue
            for m in CITATION.finditer(path.read_text(errors="replace")):
                wrong += [
                    f"{rel(path)}: {m.group(0)}" for s in m.groups() if s and s not in sections
                ]
    assert not wrong, "\n".join(wrong)
