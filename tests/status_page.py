"""The status page seen from outside, for the tests that open it: a GET
that gives status, headers and body whatever the status (:func:`get`),
the cells of its tables (:class:`Cells`) and a headless Chromium run
(:func:`run_chromium`).  Test modules take them from here, never from one
another."""

import shutil
import subprocess
import tempfile
import urllib.error
import urllib.request
from html.parser import HTMLParser

from tests.cdp import chromium


def run_chromium(*args, timeout=180):
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    try:
        return subprocess.run(
            [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update",
             "--disable-sync", f"--user-data-dir={profile}", *args],
            capture_output=True, text=True, timeout=timeout)
    finally:
        shutil.rmtree(profile, ignore_errors=True)


class Cells(HTMLParser):
    """The text of every ``<td data-label=...>`` per table row, by table id,
    and the body's attributes."""

    def __init__(self):
        super().__init__()
        self.tables = {}
        self.body = {}
        self.texts = {}
        self._table = None
        self._row = None
        self._cell = None
        self._id = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "body":
            self.body = attrs
        elif tag == "table":
            self._table = self.tables.setdefault(attrs.get("id"), [])
        elif tag == "tr" and self._table is not None:
            self._row = {}
        elif tag == "td" and self._row is not None:
            self._cell = attrs.get("data-label", "")
            self._row[self._cell] = ""
        if "id" in attrs and tag in ("span", "p", "small", "ul"):
            self._id = attrs["id"]
            self.texts[self._id] = ""

    def handle_endtag(self, tag):
        if tag == "td":
            self._cell = None
        elif tag == "tr" and self._row is not None:
            if self._row:
                self._table.append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None
        elif tag in ("span", "p", "small", "ul"):
            self._id = None

    def handle_data(self, data):
        if self._cell is not None:
            self._row[self._cell] += data
        if self._id is not None:
            self.texts[self._id] += data


def get(url, secret=None):
    request = urllib.request.Request(url)
    if secret:
        request.add_header("Authorization", f"Bearer {secret}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()
