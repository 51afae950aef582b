"""The page as one HTML file: the template files filled with the data and every script inlined.

Nothing is fetched when the page opens: plotly.js (from the plotly package) and the page's own
script and style are written into the file. What the store holds is data, never markup: it is
JSON (with ``<``, ``>`` and ``&`` and every non-ASCII character, U+2028 and U+2029 among them,
written as ``\\uXXXX`` escapes), gzipped and written in base64 inside a non-script
``<script type="application/gzip">`` element. Base64 has no ``<``, so no tag, run, metric or path
can close that element or open another; the page unpacks it with the browser's
``DecompressionStream`` and reads it with ``JSON.parse`` (never as code), and puts each string in
as text (tests/system/test_report_page.py loads hostile names in a browser). Gzipped, a 10,000-step
store's data is a fraction of plotly.js's size, where as JSON it would be more than it.
"""

from __future__ import annotations

import base64
import gzip
import html
import json
import os
import re
import secrets
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from tailorstore.access.output_dir import partial_prefix, refuse_inside_store
from tailorstore.core.errors import MissingDependencyError, StoreError
from tailorstore.store.repo import Repository

SUFFIXES = (".html", ".htm")
_SLOT = re.compile(r"\{\{ (title|style|plotly|data|script) \}\}")
_CLOSES = re.compile(r"</script|<!--", re.IGNORECASE)  # what would end an inline script early


@dataclass
class ReportResult:
    out: Path
    bytes_written: int
    steps: int
    runs: int
    seconds: float


def template(name: str) -> str:
    """A template file shipped with the package (``report/page/templates/``)."""
    return resources.files("tailorstore.report.page").joinpath("templates", name).read_text(encoding="utf-8")


def plotly_js() -> str:
    """plotly.js, minified, from the installed plotly package (a dependency: a missing one is the
    user's setup, said in one line)."""
    try:
        from plotly.offline import get_plotlyjs
    except ImportError:
        raise MissingDependencyError("the report page", "plotly", None) from None
    return get_plotlyjs()


def script_json(data: Any) -> str:
    """``data`` as JSON that is inert inside a ``<script>`` element: no ``<``, ``>``, ``&`` or
    non-ASCII character is left as itself (NaN and infinities are refused: the data has none)."""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def packed_json(data: Any) -> str:
    """``data`` as :func:`script_json`'s text, gzipped (no timestamp: the same data, the same page)
    and in base64, which the page's script unpacks."""
    return base64.b64encode(gzip.compress(script_json(data).encode("ascii"), compresslevel=9, mtime=0)).decode("ascii")


def unpack_json(text: str) -> Any:
    """What :func:`packed_json` packed: the data a page carries, as its script reads it."""
    return json.loads(gzip.decompress(base64.b64decode(text.strip(), validate=True)))


def inline_script(code: str, what: str) -> str:
    """A script to inline, refused if it could end its element (a packaging fault, not a user's)."""
    if _CLOSES.search(code):
        raise StoreError(f"{what} holds '</script' or '<!--' and cannot be inlined into the page")
    return code


def render(data: dict[str, Any]) -> str:
    """The page's HTML for ``data`` (what :func:`~tailorstore.report.page.data.report_data` returns)."""
    store = data.get("store", {})
    fill = {
        "title": html.escape(f"tailorstore: {store.get('location', '')}"),
        "style": template("page.css"),
        "plotly": inline_script(plotly_js(), "plotly.js"),
        "data": packed_json(data),
        "script": inline_script(template("page.js"), "the page's script"),
    }
    return _SLOT.sub(lambda m: fill[m.group(1)], template("page.html"))  # one pass: no filling is read again


def check_out(repo: Repository, out: Path) -> None:
    """A new or existing ``.html`` file outside the store, checked before any work is done."""
    if out.suffix.lower() not in SUFFIXES:
        raise StoreError(f"{out}: the report is an HTML page; give a path ending in .html.")
    if out.is_symlink() or (out.exists() and not out.is_file()):
        raise StoreError(f"{out}: exists and is not a regular file; give a new .html path or an old report's.")
    refuse_inside_store(out, repo)


def write_report(repo: Repository, out: Path, data: dict[str, Any], started: float | None = None) -> ReportResult:
    """Write the page whole at ``out`` (a finished page or none: never a cut one under the name)."""
    started = time.monotonic() if started is None else started
    check_out(repo, out)
    page = render(data).encode("utf-8")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f"{partial_prefix(out)}{secrets.token_hex(4)}"
    try:
        with open(tmp, "wb") as f:
            f.write(page)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    runs = len(data.get("lineage", {}).get("runs", []))
    return ReportResult(out, len(page), data.get("store", {}).get("steps", 0), runs, time.monotonic() - started)
