"""The built docs site renders in a browser: headless Chromium (Debian's ``chromium``, installed by
``scripts/bootstrap.sh``) opens the home page, a tutorial and the API page of ``scheduling.parameter_servers`` from
``build/site`` (``make docs``; built here when missing or stale), and each shows its title once the page's scripts
have run; the search index is there; a screenshot of the home page is kept at ``build/docs-screenshots/home.png``
and must not be blank. Skipped, with the reason, where no ``chromium`` is installed.
"""

from __future__ import annotations

import html
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests._docs_site import ROOT, built_site

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/bootstrap.sh adds it)")
SHOTS = ROOT / "build" / "docs-screenshots"
# no sandbox: the tests run as root in CI; virtual time: the page's scripts run before the DOM is dumped
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
         "--virtual-time-budget=3000", "--window-size=1280,1000"]


def _chromium(*args: str) -> str:
    done = subprocess.run([CHROMIUM, *FLAGS, *args], capture_output=True, text=True, timeout=120)  # type: ignore[list-item]
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture(scope="module")
def site() -> Path:
    return built_site()


@pytest.mark.parametrize("page,title,heading", [
    ("index.html", "fxdist", "fxdist"),
    ("tutorials/ps-model/index.html", "Your model on parameter servers - fxdist", "Your model on parameter servers"),
    ("reference/api/parameter_servers/index.html", "scheduling.parameter_servers - fxdist",
     "scheduling.parameter_servers"),
])
def test_page_renders_with_its_title(site: Path, page: str, title: str, heading: str):
    dom = _chromium("--dump-dom", (site / page).as_uri())
    found = re.search(r"<title>(.*?)</title>", dom, flags=re.S)
    assert found and html.unescape(found.group(1)).strip() == title
    h1 = re.search(r"<h1[^>]*>(.*?)</h1>", dom, flags=re.S)
    assert h1 and heading in re.sub(r"<[^>]+>", "", html.unescape(h1.group(1)))
    assert 'class="md-nav' in dom  # the theme's navigation was rendered
    if "api" in page:  # the docstrings rendered: the pass and its functions
        assert 'id="scheduling.placement.parameter_servers"' in dom and 'id="scheduling.placement.flush"' in dom


def test_search_index_is_present(site: Path):
    index = site / "search" / "search_index.json"
    assert index.is_file() and index.stat().st_size > 10_000
    assert '"location":"reference/api/parameter_servers/' in index.read_text().replace(" ", "")


def test_home_page_screenshot(site: Path):
    import matplotlib.image

    SHOTS.mkdir(parents=True, exist_ok=True)
    shot = SHOTS / "home.png"
    shot.unlink(missing_ok=True)
    _chromium(f"--screenshot={shot}", (site / "index.html").as_uri())
    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (1000, 1280)
    assert pixels.std() > 0.05, "the screenshot is blank"
