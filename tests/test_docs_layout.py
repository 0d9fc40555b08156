"""The documentation reads on the page: nothing a reader needs is off-screen at 1280 px (issue 28).

Static checks, no browser and no Sphinx, so they run in CI with the rest:
- every line of code written in the docs (```python, ```sh, ```diff blocks of the pages and the
  parts of the README that pages include) is at most CODE_LINE_MAX characters, what the
  content column shows without a sideways scroll (program output, ```text, is shown as printed and
  wraps at the column, as in a terminal);
- every Markdown table fits the content column: its columns' least widths (each the widest word of
  the column, measured in furo's fonts, plus the cell's padding) add up to at most COLUMN_PX, so
  the site's CSS can wrap the cells between words;
- the site's CSS colours the added lines of a diff in light and dark mode, and keeps shell
  builtins plain;
- every API reference page opens with its summary ("At a glance"), the strategy's with the names a
  reader looks for first, and groups the names and the strategy's members by use.

test_rendered_site_fits_at_1280px measures the built site in headless Chromium where Chromium and
Sphinx are installed (it is skipped elsewhere, and slow: it builds the site).
"""
from __future__ import annotations

import functools
import html
import http.server
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
CSS = DOCS / "_static" / "mirrored.css"

CODE_LINE_MAX = 88  # furo's code blocks show ~91 characters in its 736 px column (13 px monospace)
COLUMN_PX = 736  # furo's content column (46em at 16 px), the same at 1280 and 1920 px wide
# Measured in Chromium on the built site, where tables are set at 0.875em (docs/_static/mirrored.css):
# a cell's least width is its widest word; inline code is 7.0 px a character plus 4.6 px of padding
# per code span (53 characters: 393 px with the cell's padding); prose (14 px sans-serif) averages
# 6.9 px a character, capitals and "m" more, so prose is counted at 7.9; a cell adds 8 px of padding,
# 8 px of paragraph margin and a border.
_CODE_CHAR_PX, _CODE_SPAN_PX, _PROSE_CHAR_PX, _CELL_PX = 7.0, 4.6, 7.9, 17.0


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


test_docs = _load("_mirrored_test_docs", REPO / "tests" / "test_docs.py")
api = test_docs.api


def _pages() -> list[Path]:
    """The hand-written pages (generated ones, such as docs/examples/, show repository files as they are)."""
    generated = {DOCS / "examples"}
    return [p for p in test_docs.guide_pages() if not any(g in p.parents for g in generated)]


# ---- code lines -----------------------------------------------------------------------------------------

def _rel(page: Path) -> str:
    return str(page.relative_to(REPO)) if REPO in page.parents else page.name


def _long_code_lines(page: Path, limit: int) -> list[str]:
    found = []
    for block in test_docs.blocks_of(page):
        if block.language == "text":
            continue
        for k, line in enumerate(block.code.splitlines()):
            if len(line) > limit:
                found.append(f"{_rel(page)}:{block.line + k}: {len(line)} characters")
    return found


_INCLUDE = re.compile(r"```\{include\} (\S+)\n:start-after: \"(.*)\"\n:end-before: \"(.*)\"\n```")


def _included_parts(tmp_path: Path) -> list[Path]:
    """The parts of other files (the README) that pages include, each written out as a page of its own."""
    parts = []
    for page in _pages():
        for k, (target, start, end) in enumerate(_INCLUDE.findall(page.read_text())):
            text = (page.parent / target).resolve().read_text()
            part = tmp_path / f"{page.stem}-{k}-{Path(target).name}"
            part.write_text(text.split(start, 1)[1].split(end, 1)[0])
            parts.append(part)
    return parts


def test_code_lines_fit_the_column(tmp_path):
    pages = _pages()
    assert len(pages) >= 10, f"found only {pages}: the page list is broken"
    included = _included_parts(tmp_path)
    assert len(included) >= 2 and all(test_docs.blocks_of(part) for part in included), \
        "the README parts that pages include (with their code) were not found"
    long = [hit for page in pages + included for hit in _long_code_lines(page, CODE_LINE_MAX)]
    assert not long, (f"code lines longer than {CODE_LINE_MAX} characters scroll sideways at 1280 px and hide "
                      f"their end (often the `# tf:` comment): {long}. Put a side comment on its own line "
                      "above, or split the call.")


def test_generated_benchmark_commands_fit_the_column(tmp_path):
    """The Benchmarks page's commands come from the scripts' docstrings; a long side comment goes above."""
    page = tmp_path / "benchmark_commands.md"
    page.write_text(test_docs._load_docs_module("_generated").benchmark_commands(REPO / "benchmarks"))
    assert "```sh" in page.read_text()
    assert not _long_code_lines(page, CODE_LINE_MAX)


def test_the_code_line_check_sees_a_long_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n" + "y = " + "1 + " * 30 + "1\n```\n\n```text\n" + "z" * 120 + "\n```\n")
    assert [hit.split(": ")[1] for hit in _long_code_lines(page, CODE_LINE_MAX)] == ["125 characters"]


# ---- tables ------------------------------------------------------------------------------------------------

_ROLE = re.compile(r"\{py:\w+\}`(?:([^`<]*?)\s*<[^`>]*>|~?([^`]*))`")  # {py:class}`text <target>` or `name`
_CODE = re.compile(r"`([^`]+)`")
_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")


def _cell_width_px(cell: str) -> float:
    """The least width of a table cell as the browser lays it out: its widest unbreakable word."""
    cell = _LINK.sub(r"\1", cell)
    widest = 0.0
    code_words = []

    def take_code(m: re.Match) -> str:
        code_words.extend(m.group(1).split() or [""])
        return " "

    def take_role(m: re.Match) -> str:
        code_words.extend((m.group(1) or m.group(2) or "").split())
        return " "

    prose = _CODE.sub(take_code, _ROLE.sub(take_role, cell))
    for word in code_words:
        widest = max(widest, len(word) * _CODE_CHAR_PX + _CODE_SPAN_PX)
    for word in prose.split():
        widest = max(widest, len(word) * _PROSE_CHAR_PX)
    return widest + _CELL_PX


def _split_row(line: str) -> list[str]:
    """A Markdown table row's cells (a `|` inside `code` is text, not a border)."""
    cells, current, in_code = [], "", False
    for ch in line.strip().strip("|"):
        if ch == "`":
            in_code = not in_code
        if ch == "|" and not in_code:
            cells.append(current.strip())
            current = ""
        else:
            current += ch
    return cells + [current.strip()]


def _tables(page: Path) -> list[tuple[int, list[list[str]]]]:
    """(line, rows of cells) of each Markdown table of a page, outside code blocks."""
    tables, rows, start, in_code = [], [], 0, False
    for number, line in enumerate(page.read_text().splitlines() + [""], 1):
        if line.startswith("```"):
            in_code = not in_code
        if not in_code and line.startswith("|"):
            if not rows:
                start = number
            if not re.fullmatch(r"\|?[\s:|-]+\|?", line):  # not the |---|---| separator
                rows.append(_split_row(line))
        elif rows:
            tables.append((start, rows))
            rows = []
    return tables


def _too_wide(page: Path) -> list[str]:
    found = []
    for line, rows in _tables(page):
        columns = max(len(r) for r in rows)
        least = [max(_cell_width_px(r[c]) for r in rows if c < len(r)) for c in range(columns)]
        if sum(least) > COLUMN_PX:
            widest = max(range(columns), key=lambda c: least[c])
            word = max((w for r in rows if widest < len(r) for w in re.split(r"[\s`]+", r[widest])), key=len)
            found.append(f"{_rel(page)}:{line}: {round(sum(least))} px "
                         f"(columns {[round(w) for w in least]}; widest word {word!r})")
    return found


def test_tables_fit_the_column():
    pages = _pages()
    assert sum(len(_tables(p)) for p in pages) >= 4, "found almost no tables: the table parser is broken"
    wide = [hit for page in pages for hit in _too_wide(page)]
    assert not wide, (f"tables wider than the {COLUMN_PX} px content column at their narrowest: {wide}. "
                      "Shorten the widest words (a call's arguments after a space, a long name in prose "
                      "rather than code), or split the table.")


def test_the_table_check_sees_a_wide_table(tmp_path):
    page = tmp_path / "page.md"
    narrow = "| TF | ours |\n| --- | --- |\n| `tf.a(x, y)` | {py:class}`mr.A <mirrored.A>` and more words |\n"
    wide = ("| TF | ours |\n| --- | --- |\n| `tf.distribute.experimental.CommunicationOptions(options)` | "
            "{py:class}`mr.distribute.DistributedDatasetsFromFunction(options) <mirrored.X>` |\n")
    page.write_text(narrow + "\ntext\n\n" + wide)
    assert [hit.split(":")[1] for hit in _too_wide(page)] == ["7"]
    assert _split_row("| `a | b` | c |") == ["`a | b`", "c"]


# ---- the site's CSS --------------------------------------------------------------------------------------

def _rules(css: str) -> list[tuple[str, str, str]]:
    """(media query or "", selector, declarations) of every rule of a stylesheet without nesting beyond
    one @media level."""
    css = re.sub(r"/\*.*?\*/", "", css, flags=re.S)
    found = []
    for media, body in re.findall(r"(@media[^{]*)\{((?:[^{}]*\{[^{}]*\})*)\s*\}", css):
        found += [(media.strip(), s.strip(), d) for s, d in re.findall(r"([^{}]+)\{([^{}]*)\}", body)]
    plain = re.sub(r"@media[^{]*\{(?:[^{}]*\{[^{}]*\})*\s*\}", "", css)
    found += [("", s.strip(), d) for s, d in re.findall(r"([^{}]+)\{([^{}]*)\}", plain)]
    return found


def _colours(rules, media_has: str, selector_has: str, selector_lacks: str = "\0") -> list[str]:
    return [d for m, s, d in rules if media_has in m and any(selector_has in part and selector_lacks not in part
                                                           for part in s.split(","))
            and re.search(r"(^|;)\s*color\s*:", d)]


def test_added_diff_lines_are_coloured_in_light_and_dark_mode():
    """furo's light Pygments style has no rule for Generic.Inserted (`.gi`): a diff's added lines, the
    ones a reader types, looked like context. The site's CSS colours them in every theme."""
    conf = (DOCS / "conf.py").read_text()
    assert '"_static"' in conf and "mirrored.css" in conf, "conf.py does not load docs/_static/mirrored.css"
    rules = _rules(CSS.read_text())
    assert _colours(rules, "", ".highlight .gi", "data-theme"), "no light-mode colour for added diff lines"
    assert _colours(rules, "", 'body[data-theme="dark"] .highlight .gi'), "no dark-mode colour (dark theme chosen)"
    assert _colours(rules, "prefers-color-scheme: dark", ".highlight .gi"), "no dark-mode colour (system dark)"
    assert any("highlight-sh" in s and ".nb" in s for _, s, _ in rules), "shell builtins (`test`) are coloured"
    table = [d for _, s, d in rules if "table.docutils td" in s]
    assert table and "overflow-wrap" in table[0], "table cells do not wrap"
    output = [d for _, s, d in rules if "highlight-text" in s]
    assert output and "pre-wrap" in output[0], "program output does not wrap at the column"


def test_the_css_parser_sees_media_rules():
    rules = _rules("a { color: red }\n@media (prefers-color-scheme: dark) { b .x { color: blue } }")
    assert rules == [("@media (prefers-color-scheme: dark)", "b .x", " color: blue "), ("", "a", " color: red ")]


# ---- the API reference ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("reference")
    return {name: (directory / name).read_text()
            for name in api.write_reference(directory, lambda lines: lines) if name != "index.rst"}


def test_every_reference_page_opens_with_its_summary(reference):
    """Right after the title and the module target comes "At a glance", a list of names with a line each;
    then the module's docstring and the entries."""
    for name, text in reference.items():
        body = [line for line in text.split(".. py:module::", 1)[1].splitlines()[1:] if line.strip()]
        assert body[0] == f".. rubric:: {api.GLANCE_TITLE}", f"{name} opens with {body[0]!r}"
        assert body[1].startswith("* :py:obj:"), f"{name}: the summary lists no name ({body[1]!r})"
        first_entry = next(i for i, line in enumerate(body) if line.startswith(".. auto"))
        assert first_entry > 1, f"{name}: an entry comes before the summary"


def test_the_strategy_page_summary_and_order(reference):
    text = reference["mirrored.rst"]
    glance = text.split(api.GLANCE_TITLE, 1)[1].split("\n\n", 2)[1]
    for member in ("scope", "run", "reduce", "experimental_distribute_dataset", "num_replicas_in_sync",
                   "mirror", "mirror_optimizer"):
        assert f"<mirrored.Strategy.{member}>`" in glance, f"{member} is not in the strategy page's summary"
    assert glance.index("<mirrored.MirroredStrategy>") < glance.index("<mirrored.Strategy.scope>")
    # Grouped by use: the strategies first, errors last; scope and run before the multi-worker plumbing.
    assert text.index("autoclass:: mirrored.MirroredStrategy") < text.index("autoclass:: mirrored.CollectiveAllReduce")
    assert text.index("\nStrategies\n") < text.index("\nErrors\n")
    assert text.index("mirrored.Strategy.scope\n") < text.index("mirrored.Strategy.run\n") < \
        text.index("mirrored.Strategy.has_peers\n") < text.index("mirrored.Strategy.sum_over_workers\n")


def test_grouped_members_cover_the_class():
    """A member added to a grouped class still appears (under "Other members"), and a group never names
    a member that does not exist."""
    for path, groups in api.MEMBER_GROUPS.items():
        cls = test_docs._resolve(path)
        listed = [n for _, names in groups for n in names]
        missing = [n for n in listed if not hasattr(cls, n)]
        assert not missing, f"{path}: MEMBER_GROUPS names members that do not exist: {missing}"
        rendered = api._entry(path, cls)
        for name in [n for n in cls.__dict__ if not n.startswith("_")]:
            assert f":: {path}.{name}\n" in rendered, f"{path}.{name} is not in its reference entry"
    for page, groups in api.GROUPS.items():
        names = {p.path: p for p in api.namespaces()}[page].names
        stale = [n for _, group in groups for n in group if n not in names]
        assert not stale, f"GROUPS[{page!r}] names what the page does not have: {stale}"


# ---- the rendered site, in a browser ------------------------------------------------------------------------

_MEASURE_JS = r"""
const pages = %s, results = {};
function measure(doc, win) {
  const article = doc.querySelector('article'), column = article.clientWidth, r = {column, wide: [], plain_gi: []};
  article.querySelectorAll('table').forEach(t => {
    if (t.getBoundingClientRect().width > column + 1) r.wide.push('table ' + t.textContent.trim().slice(0, 60)); });
  article.querySelectorAll('div[class*=highlight-] pre').forEach(p => {
    const block = p.closest('div[class*=highlight-]');
    if (/highlight-default/.test(block.className) || block.classList.contains('repo-file')) return;
    if (p.scrollWidth > p.clientWidth + 1) r.wide.push('code ' + p.textContent.trim().slice(0, 60)); });
  for (const theme of ['light', 'dark']) {
    doc.body.dataset.theme = theme;
    doc.querySelectorAll('.highlight .gi').forEach(s => {
      const plain = win.getComputedStyle(s.closest('pre')).color, st = win.getComputedStyle(s);
      if (st.color === plain && st.backgroundColor === 'rgba(0, 0, 0, 0)') r.plain_gi.push(theme); });
  }
  const h1 = article.querySelector('h1');
  let next = h1.nextElementSibling; while (next && next.tagName === 'SPAN') next = next.nextElementSibling;
  r.after_title = next ? next.textContent.trim().slice(0, 40) : '';
  return r;
}
(async () => {
  for (const page of pages) {
    const frame = document.createElement('iframe');
    frame.style.width = '%dpx'; frame.style.height = '900px'; frame.src = page;
    document.body.appendChild(frame);
    await new Promise(done => frame.onload = done);
    await new Promise(done => setTimeout(done, 200));
    results[page] = measure(frame.contentDocument, frame.contentWindow);
    frame.remove();
  }
  document.getElementById('out').textContent = JSON.stringify(results);
})();
"""


def measure_site(site: Path, pages: list[str], width: int = 1280) -> dict[str, dict]:
    """Loads each page of a built site in headless Chromium at `width` px; per page: what is wider than
    the content column, added diff lines left uncoloured, and the text after the title."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    (site / "_measure.html").write_text('<html><body><pre id="out">pending</pre><script>'
                                        + _MEASURE_JS % (json.dumps(pages), width) + "</script></body></html>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=60000",
                               "--dump-dom", f"http://127.0.0.1:{server.server_address[1]}/_measure.html"],
                              capture_output=True, text=True, timeout=100)
    finally:
        server.shutdown()
        server.server_close()
    found = re.search(r'<pre id="out">(.*?)</pre>', done.stdout, re.S)
    assert found and found.group(1) != "pending", f"Chromium measured nothing: {done.stderr[-2000:]}"
    return json.loads(html.unescape(found.group(1)))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_rendered_site_fits_at_1280px(tmp_path):
    """Builds the site and looks at it as a reader does (Chromium at 1280 px): no table and no code or
    output block of the docs wider than the column (docstring examples, which live in src/, and
    repository files shown whole are left out), every added diff line coloured in both themes, and
    reference pages opening with their summary."""
    if not (shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")):
        pytest.skip("no Chromium here (apt-get install chromium)")
    pytest.importorskip("sphinx")
    pytest.importorskip("furo")
    site = tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "sphinx", "-q", "-b", "html", str(DOCS), str(site)],
                           capture_output=True, text=True, timeout=350)
    assert build.returncode == 0, build.stderr[-3000:]
    pages = sorted(str(p.relative_to(site)) for p in site.rglob("*.html")
                   if p.parent.name in ("guides", site.name) and p.stem not in ("genindex", "search", "py-modindex"))
    reference = sorted(str(p.relative_to(site)) for p in (site / "reference").glob("*.html") if p.stem != "index")
    results = measure_site(site, pages + reference)
    # The Benchmarks page includes benchmarks/RESULTS.md, whose tables of figures (up to 8 columns of
    # numbers) scroll inside their frame by nature; its code blocks are checked like the others.
    wide = {page: [w for w in r["wide"] if not (page == "benchmarks.html" and w.startswith("table "))]
            for page, r in results.items()}
    problems = {page: wide[page] + [f"uncoloured added diff line ({t})" for t in r["plain_gi"]]
                for page, r in results.items() if wide[page] or r["plain_gi"]}
    assert not problems, f"at 1280 px: {problems}"
    assert {r["column"] for r in results.values()} == {COLUMN_PX}, "furo's column changed: update COLUMN_PX"
    summaries = {page: results[page]["after_title"] for page in reference}
    assert all(text.startswith(api.GLANCE_TITLE) for text in summaries.values()), summaries
