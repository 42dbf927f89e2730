"""The docs are short and true at the commit (docs/design.md §6): the README ≤ 200 lines and each docs page ≤ 400;
every op of ``megakernels.ops``, every ``megakernels`` subcommand and every preset appears in them; every relative
link resolves; every command of a ```` ```bash runnable ```` block runs on the CPU (from the repository's root, as
written) and every one of a ```` ```bash gpu ```` block parses; and no code comment carries a date or a commit hash
(the reports and commit messages hold provenance)."""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "costmodel" / "README.md"]
DOCS = [README, *PAGES]
FENCE = re.compile(r"^```(\S*)[ \t]*(.*)$")


def _text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in DOCS)


def blocks(path: pathlib.Path) -> list[tuple[str, str, int, str]]:
    """``(language, marks, first line, body)`` of each fenced code block of ``path``."""
    out, lines, i = [], path.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m and m.group(1):
            start, body = i + 1, []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            out.append((m.group(1), m.group(2).strip(), start + 1, "\n".join(body)))
        i += 1
    return out


def commands(body: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments and blank lines left out."""
    out, current = [], ""
    for line in body.splitlines():
        line = line.split(" # ")[0].rstrip() if " # " in line else line.rstrip()
        if line.lstrip().startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        if current.strip():
            out.append(current.strip())
        current = ""
    return out


def test_the_readme_and_every_page_stay_short():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 200
    long = {p.name: n for p in PAGES if (n := len(p.read_text(encoding="utf-8").splitlines())) > 400}
    assert long == {}


def _subcommands() -> list[str]:
    from megakernels_models.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


def test_every_op_subcommand_and_preset_is_documented():
    import megakernels.ops as ops
    from megakernels_models.models import registry

    text = _text()
    missing = [f"op {n}" for n in ops.__all__ if f"`{n}" not in text]
    missing += [f"megakernels {c}" for c in _subcommands() if f"megakernels {c}" not in text]
    missing += [f"preset {p}" for p in registry.PRESETS if f"`{p}`" not in text]
    assert missing == []


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_every_relative_link_resolves():
    broken = [
        f"{p.relative_to(ROOT)}: {target}"
        for p in DOCS
        for target in LINK.findall(p.read_text(encoding="utf-8"))
        if "://" not in target and not (p.parent / target).resolve().exists()
    ]
    assert broken == []


def _marked(mark: str) -> list[tuple[str, str]]:
    return [
        (f"{p.relative_to(ROOT)}:{line}", body)
        for p in DOCS
        for lang, marks, line, body in blocks(p)
        if lang == "bash" and mark in marks.split()
    ]


def test_the_block_reader_sees_marks_and_joins_continuations(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("```bash runnable\nmegakernels plan \\\n  --gpus 8   # a comment\n# only a comment\n```\n")
    assert blocks(page) == [("bash", "runnable", 2, "megakernels plan \\\n  --gpus 8   # a comment\n# only a comment")]
    assert commands(blocks(page)[0][3]) == ["megakernels plan    --gpus 8"]
    assert _marked("runnable") and _marked("gpu")  # the docs mark both kinds


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TRITON_INTERPRET")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.parametrize("where, body", _marked("runnable"), ids=[w for w, _ in _marked("runnable")])
def test_runnable_commands_run_on_the_cpu(where, body):
    for cmd in commands(body):
        r = subprocess.run(cmd, shell=True, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{where}: {cmd}\n{r.stderr[-3000:]}"


def test_gpu_only_commands_parse():
    """A GPU-only command cannot run here: a ``megakernels`` one must be accepted by its subcommand's parser, a
    script must exist."""
    from megakernels_models.cli import build_parser

    parser = build_parser()
    checked = 0
    for where, body in _marked("gpu"):
        for cmd in commands(body):
            words = shlex.split(cmd)
            if words[0] == "megakernels":
                try:
                    parser.parse_args(words[1:])
                except SystemExit as e:
                    pytest.fail(f"{where}: {cmd} does not parse (exit {e.code})")
            else:
                assert (ROOT / words[0]).is_file(), f"{where}: {cmd}: no such script"
            checked += 1
    assert checked > 0


DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
# a hash named as one ("commit 5c9cecc8", "at 16d4d6d"), or a bare 7-40 digit hex word with a letter and a digit next
# to the name of a repository or a pull request
HASH = re.compile(
    r"(?:\bcommits?\b|\brevision\b|\bsha\b|@)\s*`?([0-9a-f]{7,40})\b|\b([0-9a-f]{7,40})\b\s*\(#\d+", re.IGNORECASE
)
SOURCES = ("megakernels", "megakernels_models", "csrc")
SUFFIXES = (".py", ".cpp", ".h", ".cu", ".cuh", ".sh")


def _hashlike(word: str) -> bool:
    return bool(re.search(r"[a-f]", word, re.I) and re.search(r"\d", word))


def test_no_dates_or_commit_hashes_in_code():
    bad = []
    for pkg in SOURCES:
        for path in sorted((ROOT / pkg).rglob("*")):
            if path.suffix not in SUFFIXES:
                continue
            for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                if DATE.search(line) or any(_hashlike(g) for m in HASH.finditer(line) for g in m.groups() if g):
                    bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert bad == []


def test_the_date_and_hash_checks_see_them():
    assert DATE.search("# measured on 2026-12-03")
    assert any(
        _hashlike(g) for m in HASH.finditer("rewrote it (Liger-Kernel 5c9cecc8 (#1127))") for g in m.groups() if g
    )
    assert any(_hashlike(g) for m in HASH.finditer("until commit 16d4d6d") for g in m.groups() if g)
    assert not any(_hashlike(g) for m in HASH.finditer("x = 0x5f3759df  # the magic") for g in m.groups() if g)
