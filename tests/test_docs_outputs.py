"""`.ci/docs-outputs` (re-runs the pages' shown commands; not in CI for time): how it reads a page and compares.

The slow part (the pipeplan commands) runs only by hand; here the page reading, the `...` elisions and the masks,
and the pages' `cat` commands for real (they must show the repository's files as they are)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _tool():
    loader = importlib.machinery.SourceFileLoader("docs_outputs", str(REPO / ".ci" / "docs-outputs"))
    spec = importlib.util.spec_from_loader("docs_outputs", loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_outputs"] = module  # dataclasses look their module up there
    loader.exec_module(module)
    return module


def test_a_page_reads_as_commands_with_their_outputs(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n$ not in a block\n<!-- docs-outputs: COLUMNS=150 -->\n```console\n$ pipeplan a \\\n"
                    "    --b c\nline 1\n...\nline 9\n$ cat f\nx\n```\n```\n$ pipeplan d\n```\n")
    shown = _tool().shown_commands(page)
    assert [(s.line, s.command, s.expected, s.columns) for s in shown] == [
        (5, "pipeplan a --b c", ["line 1", "...", "line 9"], 150),
        (10, "cat f", ["x"], 150),
        (14, "pipeplan d", [], 140)]


def test_elisions_stand_for_any_lines_and_nothing_else():
    matches = _tool().matches
    out = ["a", "b", "c", "d", "e"]
    assert matches(out, out) and not matches(out[:4], out) and not matches(["a", "b", "c", "e", "d"], out)
    assert matches(["...", "e"], out) and matches(["a", "..."], out) and matches(["a", "...", "c", "...", "e"], out)
    assert matches(["...", "b", "c", "..."], out) and matches(["a", "...", "b", "c", "d", "e"], out)
    assert not matches(["...", "d"], out)  # the last lines shown must end the output
    assert not matches(["b", "..."], out)  # and the first begin it
    assert not matches(["...", "c", "...", "b", "..."], out)  # in order
    assert not matches(["a", "...", "c", "d", "...", "d", "e"], out)  # one output line matches one shown line
    assert not matches(["a", "...", "e", "...", "e"], out)
    assert matches(["...", "a", "b"], ["a", "b"])  # an elision may stand for no lines


def test_masks_hide_only_what_varies_between_runs_and_machines():
    normalized = _tool().normalized
    assert normalized(["solver: dp (optimal) in 29.6 ms  ", "solver: dp (optimal) in 1.2 s"]) == \
        ["solver: dp (optimal) in <time>"] * 2
    assert normalized(["need 525.67 GiB and 22.74 GiB is free, so"]) == ["need 525.67 GiB and <n> GiB is free, so"]
    assert normalized(["solver: mixed-dp (optimal)", "iteration time 8.38 s"]) == \
        ["solver: mixed-dp (optimal)", "iteration time 8.38 s"]


def test_the_pages_cat_commands_show_the_files_as_they_are(tmp_path):
    tool = _tool()
    scratch = tool.scratch_folder(tmp_path)
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    cats = [s for p in pages for s in tool.shown_commands(p) if s.command.startswith("cat ")]
    assert len(cats) == 3  # the three frameworks' default settings
    for shown in cats:
        assert tool.matches(tool.normalized(shown.expected), tool.normalized(tool.run_shown(shown, scratch))), \
            (shown.page.name, shown.line)
