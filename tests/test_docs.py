"""The docs cannot rot: every console example in README.md and docs/*.md is run and its
saved output compared, and every relative link must point to a file (and heading) that exists.

How blocks are marked, and ``QLAB_DOCS_UPDATE=1`` / ``QLAB_DOCS_SLOW=1``: see tests/doc_examples.py.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

import doc_examples as de

BLOCKS = de.all_blocks()
UPDATE = os.environ.get("QLAB_DOCS_UPDATE") == "1"
SLOW = os.environ.get("QLAB_DOCS_SLOW") == "1"


def _diff(expected: list[str], actual: list[str]) -> str:
    import difflib

    return "\n".join(
        difflib.unified_diff(de._trim(expected), de._trim(actual), "saved", "now", lineterm="")
    )


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_example(block: de.Block):
    opts = block.options
    unknown = set(opts) - {"skip", "skip-output", "slow", "server"}
    assert not unknown, f"{block.id}: unknown doc-test option(s) {sorted(unknown)}"
    assert block.commands, f"{block.id}: a console block without a '$ ' command"
    if "skip" in opts:
        pytest.skip("marked doc-test: skip")
    if "slow" in opts and not SLOW:
        pytest.skip("slow example: run with QLAB_DOCS_SLOW=1")
    results = de.run_block(block)
    for r in results:
        assert r.returncode == 0, (
            f"{block.id}: `{r.command.line}` exited {r.returncode}\nstdout:\n"
            + "\n".join(r.stdout)
            + f"\nstderr:\n{r.stderr}"
        )
    if "skip-output" in opts:
        return
    stale = [r for r in results if not de.output_matches(r.command.expected, r.stdout)]
    if stale and UPDATE:
        de.rewrite_block(
            block, [de.updated_expected(r.command.expected, r.stdout) for r in results]
        )
        pytest.skip(
            f"{block.id}: saved output rewritten (QLAB_DOCS_UPDATE=1); review with git diff"
        )
    assert not stale, "\n\n".join(
        f"{block.id}: `{r.command.line}` prints other output than the docs save"
        f" (QLAB_DOCS_UPDATE=1 rewrites it):\n{_diff(r.command.expected, r.stdout)}"
        for r in stale
    )


@pytest.mark.parametrize(
    "path", de.doc_files(), ids=[str(p.relative_to(de.ROOT)) for p in de.doc_files()]
)
def test_links(path):
    assert not de.broken_links(path)


@pytest.mark.slow
def test_every_subcommand_has_a_readme_example():
    text = subprocess.run(
        de.qlab_argv() + ["--help"], capture_output=True, text=True, check=True
    ).stdout
    subcommands = re.search(r"\{([\w,-]+)\}", text).group(1).split(",")
    readme = [c.line for b in BLOCKS if b.path.name == "README.md" for c in b.commands]
    missing = [
        s for s in subcommands if not any(line.split()[:2] == ["qlab", s] for line in readme)
    ]
    assert not missing, f"README.md has no console example of: {missing}"


def test_every_doc_page_is_linked_from_the_readme():
    linked = {
        (de.ROOT / t.partition("#")[0]).resolve() for t in de.relative_links(de.ROOT / "README.md")
    }
    pages = [p for p in de.doc_files()[1:] if p.resolve() not in linked]
    assert not pages, f"docs pages the README does not link: {[p.name for p in pages]}"


def test_every_schema_column_is_documented():
    from qsim.records import SCHEMA

    text = (de.ROOT / "docs" / "schema.md").read_text(encoding="utf-8")
    missing = [c for c in SCHEMA if not re.search(rf"\b{re.escape(c)}\b", text)]
    assert not missing, f"docs/schema.md does not describe: {missing}"


# ---------------------------------------------------------------- the harness itself


def test_matching_rules():
    assert de.output_matches(["a", "...", "d"], ["a", "b", "c", "d"])
    assert de.output_matches(["a", "...", "b"], ["a", "b"])
    assert de.output_matches(["took ... s"], ["took 0.4 s   "])
    assert not de.output_matches(["a", "b"], ["a", "c"])
    assert not de.output_matches(["a"], ["a", "b"])
    assert de.updated_expected(["a", "...", "z"], ["b", "x", "y", "w"]) == ["b", "...", "w"]
    assert de.updated_expected(["n ... s", "x"], ["n 3 s", "y"]) == ["n ... s", "y"]


def test_parse_and_rewrite(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n<!-- doc-test: skip-output; server: --policy bounded -->\n```console\n"
        "$ qlab a \\\n  --b\nout 1\n$ qlab c\n```\n\n```console\n$ qlab d\nold\n```\n"
    )
    first, second = de.parse_blocks(page)
    assert first.options == {"skip-output": "", "server": "--policy bounded"}
    assert [c.line for c in first.commands] == ["qlab a --b", "qlab c"]
    assert first.commands[0].expected == ["out 1"]
    de.rewrite_block(second, [["new", "lines"]])
    assert page.read_text().endswith("```console\n$ qlab d\nnew\nlines\n```\n")
