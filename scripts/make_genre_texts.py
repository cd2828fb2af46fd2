#!/usr/bin/env python3
"""Rebuild the three perplexity genre texts in data/ from Debian 12 packages.

    python3 scripts/make_genre_texts.py [--out DIR]      (DIR defaults to data/)

It makes:

  code_python_email.txt         all .py files of Python 3.11's standard-library `email` package,
                                unchanged, in path order, each after a one-line
                                `# ===== file: Lib/email/NAME.py =====` header. Taken from the
                                Debian package libpython3.11-minimal.
  tech_sqlite_internals.txt     eleven SQLite design documents (architecture, file format, atomic
                                commit, locking, WAL, ...), HTML turned into wrapped plain text.
                                Taken from the Debian package sqlite3-doc.
  dialogue_python_tutorial.txt  the whole Python 3.11 tutorial, HTML turned into plain text. Taken
                                from the Debian package python3.11-doc.

It downloads the three packages with `apt-get download` into a temporary directory (the versions
named in data/README.md when apt can still get them, otherwise the current ones, with a warning),
unpacks them there with `dpkg-deb -x`, and reads only the unpacked files, not the running system's.
So it needs a Debian-like system with apt-get and dpkg-deb and the bookworm archive in its sources;
nothing else beyond the Python 3 standard library. It prints each file's size and sha256 and exits
with status 1 if a sha256 differs from the one in data/README.md's table; such a file is written as
NAME.new beside NAME, so that the recorded copy is not overwritten. Debian's archive keeps only the
latest update of a package, so a pinned version can disappear (libpython3.11-minimal
3.11.2-6+deb12u6 has: its successors' email package has security fixes, and code_python_email.txt
then differs). The recorded files were made with Python 3.11; another Python's html.parser or
textwrap could change the converted text, which the hash check would report.

Licences: the Python source code and the Python tutorial are under the PSF License Version 2
(Copyright (c) 2001-2023 Python Software Foundation; All Rights Reserved; the tutorial's code
examples are also under the Zero-Clause BSD licence); its text is in
data/licenses/python-3.11-LICENSE.txt, and data/README.md lists the changes made, as that licence
asks. The SQLite documentation is in the public domain.
"""
import argparse
import hashlib
import html.parser
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "data", "README.md")

# The package versions that data/README.md names (the ones the recorded files came from).
PACKAGES = {
    "libpython3.11-minimal": "3.11.2-6+deb12u6",
    "sqlite3-doc": "3.40.1-2+deb12u2",
    "python3.11-doc": "3.11.2-6+deb12u9",
}

SQLITE_PAGES = ["arch", "fileformat2", "atomiccommit", "lockingv3", "wal", "isolation",
                "tempfiles", "queryplanner", "optoverview", "queryplanner-ng", "howtocorrupt"]
TUTORIAL_PAGES = ("appetite interpreter introduction controlflow datastructures modules "
                  "inputoutput errors classes stdlib stdlib2 venv whatnow interactive "
                  "floatingpoint appendix").split()

# Typographic characters replaced by ASCII in both converted texts.
TYPO = {"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2026": "...",
        "\u2014": "--", "\u2013": "-", "\u00a0": " "}

PRE_START, PRE_END = "\x01", "\x02"  # mark <pre> blocks in the raw text until the layout pass


# ---------------------------------------------------------------------------------------------
# HTML converters (stdlib html.parser). Both collect text with block tags turned into newlines,
# collapse whitespace outside <pre>, and mark <pre> blocks; _layout() then wraps the prose.

# SQLite's pages (plain hand-written HTML).
# Drops: <head> (but keeps <title> as the page title), <script>, <style>, <svg>, <map>, and the
# divs of class nosearch, fancy_toc, menu and searchmenu (navigation and tables of contents);
# images give nothing. Keeps: all other text; headings, paragraphs, tables, lists and
# blockquotes become blank-line-separated blocks, list items start with "- ", table cells are
# joined by spaces on one line, <pre> blocks are kept as they are (tabs as four spaces).
SQLITE_BLOCK = {"p", "div", "br", "h1", "h2", "h3", "h4", "h5", "h6", "li", "tr", "table", "ul",
                "ol", "dl", "dt", "dd", "blockquote", "hr", "center", "pre"}
SQLITE_SKIP = {"script", "style", "svg", "head", "map"}
SQLITE_SKIP_DIVS = (["nosearch"], ["fancy_toc"], ["menu"], ["searchmenu"])


class SqliteDocParser(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out = []
        self.skip = 0      # depth inside a dropped element (counting divs and SQLITE_SKIP tags)
        self.pre = 0
        self.title = ""
        self.intitle = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "title":
            self.intitle = True
        if self.skip:
            if tag == "div" or tag in SQLITE_SKIP:
                self.skip += 1
            return
        if tag in SQLITE_SKIP or (tag == "div" and
                                  (a.get("class") or "").split()[:1] in SQLITE_SKIP_DIVS):
            self.skip = 1
            return
        if tag == "pre":
            self.pre += 1
            self.out.append("\n\n" + PRE_START)
        elif tag in ("h1", "h2", "h3", "h4", "h5", "h6"):
            self.out.append("\n\n")
        elif tag == "li":
            self.out.append("\n- ")
        elif tag in ("td", "th"):
            self.out.append(" ")
        elif tag in SQLITE_BLOCK:
            self.out.append("\n\n" if tag in ("p", "table", "ul", "ol", "blockquote", "dl")
                            else "\n")

    def handle_endtag(self, tag):
        if tag == "title":
            self.intitle = False
        if self.skip:
            if tag == "div" or tag in SQLITE_SKIP:
                self.skip -= 1
            return
        if tag == "pre":
            self.pre -= 1
            self.out.append(PRE_END + "\n\n")
        elif tag in ("h1", "h2", "h3", "h4", "h5", "h6", "p", "table", "ul", "ol", "blockquote",
                     "dl"):
            self.out.append("\n\n")
        elif tag in SQLITE_BLOCK:
            self.out.append("\n")

    def handle_data(self, d):
        if self.intitle:
            self.title += d
        if self.skip:
            return
        self.out.append(d if self.pre else re.sub(r"\s+", " ", d))


# Python's Sphinx-made HTML pages.
# Drops: everything outside <div role="main"> (header, sidebar, navigation, footer), and inside
# it <script>, <style>, <svg> and the elements of class "headerlink" (the pilcrow links after
# headings); images give nothing. Keeps: the text of the main body; sections, headings,
# paragraphs, tables, lists and blockquotes become blank-line-separated blocks, list items start
# with "* ", <pre> blocks (code and >>> sessions) are kept as they are, indented by four spaces.
SPHINX_BLOCK2 = {"p", "table", "ul", "ol", "dl", "blockquote", "h1", "h2", "h3", "h4", "h5", "h6",
                 "section", "figure"}
SPHINX_BLOCK1 = {"div", "br", "li", "tr", "dt", "dd", "hr", "caption"}
SPHINX_SKIP = {"script", "style", "svg"}


class SphinxParser(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out = []
        self.inmain = 0    # div depth inside <div role="main">; 0 = outside
        self.skip = None   # [tag, depth] of a dropped element
        self.pre = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        cls = (a.get("class") or "").split()
        if not self.inmain:
            if tag == "div" and a.get("role") == "main":
                self.inmain = 1
            return
        if tag == "div":
            self.inmain += 1
        if self.skip:
            if tag == self.skip[0]:
                self.skip[1] += 1
            return
        if tag in SPHINX_SKIP or "headerlink" in cls:
            self.skip = [tag, 1]
            return
        if tag == "pre":
            self.pre += 1
            self.out.append("\n\n" + PRE_START)
        elif tag == "li":
            self.out.append("\n* ")
        elif tag in ("td", "th"):
            self.out.append(" ")
        elif tag in SPHINX_BLOCK2:
            self.out.append("\n\n")
        elif tag in SPHINX_BLOCK1:
            self.out.append("\n")

    def handle_endtag(self, tag):
        if not self.inmain:
            return
        if tag == "div":
            self.inmain -= 1
            if not self.inmain:
                return
        if self.skip:
            if tag == self.skip[0]:
                self.skip[1] -= 1
                if not self.skip[1]:
                    self.skip = None
            return
        if tag == "pre":
            self.pre -= 1
            self.out.append(PRE_END + "\n\n")
        elif tag in SPHINX_BLOCK2:
            self.out.append("\n\n")
        elif tag in SPHINX_BLOCK1:
            self.out.append("\n")

    def handle_data(self, d):
        if not self.inmain or self.skip:
            return
        self.out.append(d if self.pre else re.sub(r"\s+", " ", d))


def _layout(raw, pre_indent, bullet):
    """Lay out a parser's raw text: prose lines stripped and wrapped at 78 columns (long words
    and hyphenated words not broken); <pre> blocks kept line for line (tabs as four spaces,
    trailing spaces and outer blank lines dropped, non-blank lines prefixed by pre_indent); a
    bullet left alone on its line joined to the text that follows; runs of blank lines cut to
    one; one final newline."""
    out = []
    for i, seg in enumerate(re.split("[" + PRE_START + PRE_END + "]", raw)):
        if i % 2:  # inside <pre>
            out.append("\n".join(pre_indent + l.rstrip() if l.strip() else ""
                                 for l in seg.replace("\t", "    ").strip("\n").split("\n")))
        else:
            lines = []
            for line in seg.split("\n"):
                s = line.strip()
                lines.extend(textwrap.wrap(s, 78, break_long_words=False, break_on_hyphens=False)
                             if s else [""])
            out.append("\n".join(lines))
    txt = re.sub(r"(?m)^" + re.escape(bullet) + r" *\n+(?=\S)", bullet + " ", "\n".join(out))
    txt = re.sub(r"\n{3,}", "\n\n", txt).strip("\n")
    return txt + "\n"


def convert_sqlite(path):
    """(title, text) of one SQLite documentation page."""
    p = SqliteDocParser()
    with open(path, encoding="utf-8", errors="replace") as f:
        p.feed(f.read())
    p.close()
    return p.title.strip(), _layout("".join(p.out), "", "-")


def convert_sphinx(path):
    """Text of the main body of one Sphinx page."""
    p = SphinxParser()
    with open(path, encoding="utf-8") as f:
        p.feed(f.read())
    p.close()
    return _layout("".join(p.out), "    ", "*")


def ascii_typography(txt):
    for k, v in TYPO.items():
        txt = txt.replace(k, v)
    return txt


# ---------------------------------------------------------------------------------------------
# The three texts.

def make_code(root):
    """All .py files under usr/lib/python3.11/email of the unpacked libpython3.11-minimal."""
    lib = os.path.join(root, "usr", "lib", "python3.11")
    files = []
    for d, subs, fs in os.walk(os.path.join(lib, "email")):
        subs[:] = sorted(s for s in subs if s != "__pycache__")
        files += [os.path.join(d, f) for f in sorted(fs) if f.endswith(".py")]
    if not files:
        sys.exit("make_genre_texts: no email/*.py in the unpacked libpython3.11-minimal")
    out = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            src = f.read()
        if not src.endswith("\n"):
            src += "\n"
        out.append("# ===== file: %s =====\n%s" % ("Lib/" + os.path.relpath(path, lib), src))
    return "\n".join(out)


def make_tech(root):
    d = os.path.join(root, "usr", "share", "doc", "sqlite3")
    parts = []
    for page in SQLITE_PAGES:
        title, body = convert_sqlite(os.path.join(d, page + ".html"))
        lines = body.split("\n")
        if lines and lines[0].strip() == title:  # drop the <h1> that repeats the title
            lines = lines[1:]
        body = "\n".join(lines).strip("\n")
        parts.append("=== %s (SQLite documentation, %s.html) ===\n\n%s\n" % (title, page, body))
    return ascii_typography("\n\n".join(parts))


def make_tutorial(root):
    d = os.path.join(root, "usr", "share", "doc", "python3.11", "html", "tutorial")
    parts = ["The Python Tutorial (Python 3.11 documentation)\n"]
    for page in TUTORIAL_PAGES:
        parts.append("=== tutorial/%s.html ===\n\n%s"
                     % (page, convert_sphinx(os.path.join(d, page + ".html"))))
    return ascii_typography("\n\n".join(parts))


# ---------------------------------------------------------------------------------------------

def fetch(pkg, version, tmp):
    """Download pkg (pinned to version if apt still has it) into tmp and unpack it into
    tmp/pkg; returns (unpacked root, the version got)."""
    dl = os.path.join(tmp, "deb")
    os.makedirs(dl, exist_ok=True)
    r = subprocess.run(["apt-get", "download", "%s=%s" % (pkg, version)], cwd=dl,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        print("make_genre_texts: warning: apt-get cannot get %s %s (the version data/README.md "
              "names); using the current version instead" % (pkg, version), file=sys.stderr)
        r = subprocess.run(["apt-get", "download", pkg], cwd=dl,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            sys.exit("make_genre_texts: apt-get download %s failed:\n%s" % (pkg, r.stdout))
    debs = [f for f in os.listdir(dl) if f.startswith(pkg + "_") and f.endswith(".deb")]
    if len(debs) != 1:
        sys.exit("make_genre_texts: expected one %s_*.deb in %s, found %s" % (pkg, dl, debs))
    deb = os.path.join(dl, debs[0])
    got = subprocess.run(["dpkg-deb", "-f", deb, "Version"], check=True,
                         stdout=subprocess.PIPE, text=True).stdout.strip()
    root = os.path.join(tmp, pkg)
    subprocess.run(["dpkg-deb", "-x", deb, root], check=True)
    print("%s %s%s" % (pkg, got, "" if got == version else "  (README names %s)" % version))
    return root, got


def recorded_hashes():
    """{file name: sha256} from the rows of data/README.md's table."""
    hashes = {}
    with open(README, encoding="utf-8") as f:
        for line in f:
            m = re.match(r"\|\s*`([^`]+)`\s*\|", line)
            h = re.search(r"`([0-9a-f]{64})`", line)
            if m and h:
                hashes[m.group(1)] = h.group(1)
    return hashes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(REPO, "data"),
                    help="directory to write the three files to (default: data/)")
    args = ap.parse_args()
    for tool in ("apt-get", "dpkg-deb"):
        if not shutil.which(tool):
            sys.exit("make_genre_texts: needs %s (a Debian-like system)" % tool)
    want = recorded_hashes()
    os.makedirs(args.out, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="genre-texts-") as tmp:
        roots = {pkg: fetch(pkg, version, tmp)[0] for pkg, version in PACKAGES.items()}
        texts = [
            ("code_python_email.txt", make_code(roots["libpython3.11-minimal"])),
            ("tech_sqlite_internals.txt", make_tech(roots["sqlite3-doc"])),
            ("dialogue_python_tutorial.txt", make_tutorial(roots["python3.11-doc"])),
        ]

    bad = []
    for name, txt in texts:
        data = txt.encode("utf-8")
        got = hashlib.sha256(data).hexdigest()
        ok = want.get(name) == got
        path = os.path.join(args.out, name if ok else name + ".new")
        with open(path, "wb") as f:
            f.write(data)
        print("%-30s %9d B  sha256 %s" % (name, len(data), got))
        if not ok:
            bad.append("%s: sha256 %s, data/README.md records %s (written as %s)"
                       % (name, got, want.get(name, "none"), path))
    if bad:
        print("make_genre_texts: output differs from the recorded files:\n  " + "\n  ".join(bad),
              file=sys.stderr)
        return 1
    print("all three match data/README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
