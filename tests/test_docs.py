"""The docs stay inside the repository: every Markdown file and every repository path that README.md and docs/
mention exists here, and none points outside (absolute paths, `../`, the developers' private notes)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# Folders of the repository, not local outputs that .gitignore names (`/runs/`, `/outputs/`): a doc that names
# `runs/x` as a command's output is not referring to a repository file, whether or not this checkout has run it.
IGNORED = {ln.strip().strip("/") for ln in (ROOT / ".gitignore").read_text().splitlines()
           if ln.strip().startswith("/") and ln.strip().endswith("/")}
TOP_LEVEL = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name not in IGNORED}
IN_REPO = {p.name for p in ROOT.rglob("*")
           if ".venv" not in p.parts and ".git" not in p.parts and p.relative_to(ROOT).parts[0] not in IGNORED}


def references(text: str) -> list[str]:
    """Markdown link targets, `.md` file names, and paths that start at a top-level folder of the repository."""
    refs = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not t.startswith(("http://", "https://", "#"))]
    refs += re.findall(r"[\w./-]*\w\.md\b", text)
    refs += [m for m in re.findall(r"(?<![\w./<-])([a-z_]+/[\w./-]*\w)", text) if m.split("/")[0] in TOP_LEVEL]
    return list(dict.fromkeys(r.split("#")[0] for r in refs))


def missing(doc: Path) -> list[str]:
    bad = []
    for ref in references(doc.read_text()):
        if ref.startswith(("/", "~")) or "../" in ref:
            bad.append(ref)  # outside the repository by construction
        elif "/" in ref:
            if not ((ROOT / ref).exists() or (doc.parent / ref).exists()):
                bad.append(ref)
        elif ref not in IN_REPO:  # a bare file name: some file of the repository must have it
            bad.append(ref)
    return bad


def test_docs_reference_only_files_in_the_repository():
    found = {str(doc.relative_to(ROOT)): missing(doc) for doc in DOCS}
    found = {doc: refs for doc, refs in found.items() if refs}
    assert not found, f"references to files that are not in the repository: {found}"


def test_the_check_sees_notes_absolute_paths_and_missing_repository_files(tmp_path):
    doc = tmp_path / "page.md"
    doc.write_text("See beam-numerics.md §3, `/work/shared/notes/x.md`, [a](../outside.md), `docs/nope.md`, "
                   "`beamrl/no_such_module.py` and `beamrl/models/beam/numerics.py` (fine), [b](#anchor).")
    assert sorted(missing(doc)) == sorted(["beam-numerics.md", "/work/shared/notes/x.md", "../outside.md",
                                           "docs/nope.md", "beamrl/no_such_module.py"])
