"""Technical documentation shipped in Debian packages -> plain English documents (the "docs" sources of
the English slice): HTML pages (Sphinx, mdBook, DocBook) reduced to their main text, reStructuredText
sources, Perl POD and the documentation strings of botocore's service models.

Each extractor takes `(member name, bytes)` pairs, like those of `sources.py`, so it can be tested on small
synthetic archives."""

from __future__ import annotations

import html
import json
import re
from html.parser import HTMLParser

from lowprec.data.textutil import Members, text, tidy

# elements whose text is never prose
SKIP_TAGS = {"script", "style", "head", "nav", "footer", "noscript", "svg", "button", "form", "template",
             "select", "math"}
# elements that start a new line of text
BLOCK_TAGS = {"p", "div", "section", "article", "main", "br", "li", "ul", "ol", "dl", "dt", "dd", "pre",
              "table", "tr", "blockquote", "h1", "h2", "h3", "h4", "h5", "h6", "hr", "figure", "figcaption",
              "caption", "header", "aside", "details", "summary"}
VOID_TAGS = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param", "source",
             "track", "wbr"}
# class names of navigation and decoration (Sphinx, pydata theme, mdBook, DocBook/Publican, rustdoc)
SKIP_CLASSES = {"headerlink", "sphinxsidebar", "related", "navheader", "navfooter", "docnav", "bd-sidebar",
                "bd-sidebar-primary", "bd-sidebar-secondary", "bd-toc", "bd-header", "bd-footer",
                "prev-next-area",
                "nav-chapters", "nav-wrapper", "nav", "menu-bar", "sidebar-scrollbox", "toc", "breadcrumb",
                "breadcrumbs", "footer", "copyright", "docs-navigation", "skip-link", "search", "searchbox",
                "highlight-default-linenos", "linenos", "viewcode-link", "anchor", "doc-anchor", "docNav",
                "legalnotice", "edit-this-page", "header-article", "admonition-title-icon"}
SKIP_IDS = {"sidebar", "searchbox", "mdbook-sidebar", "searchbar-outer", "search-wrapper", "banner", "title",
            "hd", "ft", "global-nav"}
SKIP_ROLES = {"navigation", "search", "banner", "contentinfo"}


class _MainText(HTMLParser):
    """Collects text inside the page's main element (<main>, role="main", or else <body>), skipping
    navigation, scripts and decoration; block elements become line breaks, <pre> keeps its whitespace."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, bool, bool]] = []  # (tag, skipping, main) of the open elements
        self.skip = 0  # depth inside skipped elements
        self.pre = 0
        self.main_depth = 0  # > 0 inside a main element
        self.main_text: list[str] = []
        self.body_text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag in VOID_TAGS:
            if tag in ("br", "hr") and not self.skip:
                self._emit("\n")
            return
        a = dict(attrs)
        classes = set((a.get("class") or "").split())
        skipping = (tag in SKIP_TAGS or a.get("role") in SKIP_ROLES or bool(classes & SKIP_CLASSES)
                    or a.get("aria-hidden") == "true" or a.get("hidden") is not None
                    or a.get("id") in SKIP_IDS)
        main = tag == "main" or a.get("role") == "main"
        self.stack.append((tag, skipping, main))
        self.skip += skipping
        self.main_depth += main
        self.pre += tag == "pre"
        if tag in BLOCK_TAGS and not self.skip:
            self._emit("\n\n" if tag in ("p", "pre", "h1", "h2", "h3", "h4", "h5", "h6", "section") else "\n")
        if tag == "li" and not self.skip:
            self._emit("- ")
        if "classifier" in classes and not self.skip:  # Sphinx: "name : type" of a parameter
            self._emit(" : ")

    def handle_endtag(self, tag):
        if tag in VOID_TAGS or not any(t == tag for t, _, _ in self.stack):
            return
        while self.stack:  # close the element and any left open inside it
            t, skipping, main = self.stack.pop()
            self.skip -= skipping
            self.main_depth -= main
            self.pre -= t == "pre"
            if t in BLOCK_TAGS and not self.skip:
                self._emit("\n")
            if t == tag:
                break

    def handle_data(self, data):
        if self.skip:
            return
        self._emit(data if self.pre else re.sub(r"\s+", " ", data))

    def _emit(self, s: str) -> None:
        if self.main_depth:
            self.main_text.append(s)
        self.body_text.append(s)

    def result(self) -> str:
        return "".join(self.main_text if self.main_text else self.body_text)


MAIN_START = re.compile(r"<main\b|<(?:div|article|section)\b[^>]*\brole=\"main\"")


def html_text(page: str) -> str:
    """The main text of an HTML page, one paragraph a block, navigation and scripts left out."""
    start = MAIN_START.search(page)
    if start:  # parse from the main element on: the navigation before it can be most of the page
        page = page[start.start():]
    parser = _MainText()
    parser.feed(page)
    parser.close()
    lines = [line.strip() if not line.startswith(" " * 4) else line.rstrip()
             for line in parser.result().split("\n")]
    s = re.sub(r"(?m)^-[ \t]*\n(?:[ \t]*\n)*(?=[ \t]*\S)", "- ", "\n".join(lines))  # "- " + the item's text
    return tidy(s)


def html_pages(members: Members) -> list[str]:
    """One document per HTML page."""
    return [html_text(text(data)) for _, data in members]


def rst_files(members: Members) -> list[str]:
    """reStructuredText sources as they are (Sphinx's _sources/*.rst.txt): one document per file."""
    return [tidy(text(data)) for _, data in members]


def pod_text(pod: str) -> str:
    """Perl POD -> plain text: headings and items kept as lines, formatting codes (B<>, C<<>>, L<|>)
    unwrapped, =begin/=end blocks for other formatters dropped."""
    pod = re.sub(r"^=begin\s+(\S+).*?^=end\s+\1\s*$", "", pod, flags=re.M | re.S)
    out = []
    for line in pod.split("\n"):
        m = re.match(r"^=(\w+)\s*(.*)$", line)
        if m:
            command, rest = m.groups()
            if command.startswith("head"):
                out.append(f"\n{rest}\n")
            elif command == "item":
                out.append(f"- {rest.lstrip('* ').strip()}" if rest.strip() not in ("", "*") else "-")
            continue  # =pod, =cut, =over, =back, =for, =encoding
        out.append(line)
    s = "\n".join(out)
    for _ in range(3):  # nested codes, innermost first
        s = re.sub(r"[A-Z]<<+\s+(.*?)\s+>>+", lambda m: m.group(1), s, flags=re.S)
        s = re.sub(r"L<([^<>|]*)\|[^<>]*>", r"\1", s)
        s = re.sub(r"[BCIFSLXEZ]<([^<>]*)>", lambda m: _pod_code(m.group(0)[0], m.group(1)), s)
    return tidy(s)


def _pod_code(code: str, inner: str) -> str:
    if code == "E":
        names = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/"}
        if inner in names:
            return names[inner]
        try:
            base = 16 if inner[:2].lower() == "0x" else 8 if inner[:1] == "0" and len(inner) > 1 else 10
            return chr(int(inner, base)) if inner[:1].isdigit() else html.unescape(f"&{inner};")
        except ValueError:
            return inner
    if code in "XZ":
        return ""
    if code == "L":
        return inner.split("/")[-1].strip('"') if "://" not in inner else inner
    return inner


def pod_files(members: Members) -> list[str]:
    """One document per .pod file."""
    return [pod_text(text(data)) for _, data in members]


def botocore_docs(members: Members) -> list[str]:
    """botocore's service models (service-2.json): the "documentation" strings (HTML fragments) of the
    service, its operations and its shapes, as one document per service, each string a paragraph
    ("Name: text"); a string that recurs on many shapes is kept at its first use."""
    docs = []
    for _, data in members:
        model = json.loads(data)
        meta = model.get("metadata", {})
        entries = [(meta.get("serviceFullName") or meta.get("serviceId") or "", model.get("documentation"))]
        for group in ("operations", "shapes"):
            for key, item in model.get(group, {}).items():
                entries.append((key, item.get("documentation")))
                for member, spec in (item.get("members") or {}).items():
                    if isinstance(spec, dict):
                        entries.append((f"{key}.{member}", spec.get("documentation")))
        seen, kept = set(), []
        for i, (key, doc) in enumerate(entries):
            body = html_text(doc) if doc else ""
            if body and body not in seen:
                seen.add(body)
                kept.append((f"{key}\n\n{body}" if key else body) if i == 0 else f"{key}: {body}")
        docs.append(tidy("\n\n".join(kept)))
    return docs
