"""`embarkc report`: a self-contained page whose figures decode in a real browser."""

from __future__ import annotations

import base64
import io
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from test_diff import PLACE_A, TABLES_A, build_plan

from embark_runtime.plan import dumps_plan
from embarkc import report
from embarkc.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

_DECODE_CHECK = """<script>
window.addEventListener("load", () => {
  const imgs = Array.from(document.images);
  const ok = imgs.filter((i) => i.complete && i.naturalWidth > 0).length;
  document.body.setAttribute("data-decoded", ok + "/" + imgs.length);
});
</script>
</body>"""


def _plan_file(tmp_path: Path, **kw) -> str:
    p = tmp_path / "plan.json"
    p.write_text(dumps_plan(build_plan(TABLES_A, PLACE_A, **kw)))
    return str(p)


def _colours(png: bytes) -> int:
    import matplotlib.image as mpimg

    img = mpimg.imread(io.BytesIO(png), format="png")
    assert img.shape[0] > 100 and img.shape[1] > 100
    flat = (img[..., :3] * 255).astype(np.uint8).reshape(-1, 3)
    return len(np.unique(flat, axis=0))


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> str:
    """The HTML report of the hand-built plan, rendered once through the command line."""
    tmp = tmp_path_factory.mktemp("report")
    out = tmp / "r.html"
    assert main(["report", _plan_file(tmp), "-o", str(out)]) == 0
    return out.read_text()


def test_html_is_self_contained_with_decodable_figures(page):
    html = page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html), "external resource"
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    assert len(images) == 4
    for b64 in images:
        png = base64.b64decode(b64)
        assert png.startswith(PNG_MAGIC) and _colours(png) > 8  # drawn, not blank
    for text in ("rb_user", "optimal", "table-wise", "critical rank 1", "Clusters"):
        assert text in html


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_composite_figure(tmp_path, suffix):
    out = tmp_path / f"r{suffix}"
    assert main(["report", _plan_file(tmp_path), "-o", str(out)]) == 0
    data = out.read_bytes()
    if suffix == ".png":
        assert data.startswith(PNG_MAGIC) and _colours(data) > 8
    else:
        assert b"<svg" in data[:2000] and data.count(b"<path") > 20


def test_outside_plan_without_our_fields_still_reports(tmp_path):
    out = tmp_path / "r.html"
    assert main(["report", _plan_file(tmp_path, with_costs=False), "-o", str(out)]) == 0
    html = out.read_text()
    assert "contract fields only" in html and "share of each table&#39;s parameters" in html


def test_big_plan_heat_map_stays_legible():
    nodes, gpus = 16, 8
    world = nodes * gpus
    tables = [(f"t{i}", 1000 + 37 * i, 16, "sgd") for i in range(500)]
    place: dict[str, tuple] = {}
    for i, (name, *_rest) in enumerate(tables):
        if i % 5 == 0:
            place[name] = ("dp",)
        else:
            place[name] = (
                "rb" if i % 2 else "ub",
                2,
                (8, 8),
                tuple((i + k) % world for k in range(4)),
            )
    d = report.report_data(build_plan(tables, place, nodes=nodes, gpus=gpus))
    assert d.heat.shape == (report.HEATMAP_TABLES + 3, world)
    assert np.allclose(d.heat.sum(axis=1), 1.0)
    folded = [re.fullmatch(r"(\d+) other (rb|ub|dp) tables", r) for r in d.heat_rows[-3:]]
    assert all(folded) and [m.group(2) for m in folded if m] == ["rb", "ub", "dp"]
    assert sum(int(m.group(1)) for m in folded if m) == 500 - report.HEATMAP_TABLES
    # the costliest tables come first (the toy cost grows with the rows)
    assert d.heat_rows[0] == "t499 (rb)"


def test_bad_output_and_bad_plan_are_user_errors(tmp_path, capsys):
    assert main(["report", _plan_file(tmp_path), "-o", str(tmp_path / "r.pdf")]) == 2
    assert "must end in .html, .png or .svg" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "embark-plan", "version": 7}')
    assert main(["report", str(bad), "-o", str(tmp_path / "r.html")]) == 2
    assert "invalid plan (version)" in capsys.readouterr().err


def _decoded_in_chromium(chromium: str, page: Path) -> str:
    proc = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--virtual-time-budget=10000",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    m = re.search(r'data-decoded="([^"]*)"', proc.stdout)
    assert m, f"chromium printed no DOM: {proc.stderr[-2000:]}"
    return m.group(1)


def test_page_renders_with_its_figures_in_headless_chromium(page, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    html = page
    page = tmp_path / "checked.html"
    page.write_text(html.replace("</body>", _DECODE_CHECK))
    assert _decoded_in_chromium(chromium, page) == "4/4"
    # the check can fail: a figure with broken data does not decode
    broken = re.sub(r"base64,[A-Za-z0-9+/]{40}", "base64,AAAA", html, count=1)
    page.write_text(broken.replace("</body>", _DECODE_CHECK))
    assert _decoded_in_chromium(chromium, page) == "3/4"


def test_the_baseline_panel_draws_both_bounds_each_named(tmp_path):
    """CP-SAT's bound holds for its last model only; the lower bound for any plan."""
    plt = report._pyplot()
    d = report.report_data(build_plan(TABLES_A, PLACE_A))
    fig, ax = plt.subplots()
    report.plot_baselines(ax, d)
    lines = {line.get_label(): line.get_xdata()[0] for line in ax.get_lines()}
    plt.close(fig)
    assert d.view.lower_bound is not None and d.view.bound is not None
    assert lines == {
        "lower bound (any plan)": pytest.approx(d.view.lower_bound * 1e3),
        "cp-sat bound (its last model)": pytest.approx(d.view.bound * 1e3),
    }
    # and the caption says which line is which, as the figure draws them
    html = report.render_html(d)
    assert "the solid line is the lower bound on any plan" in html
    assert "the dotted one CP-SAT's bound" in html


def test_a_plan_alone_finds_its_spec_for_the_heat_map(tmp_path, monkeypatch):
    """Given only plan.json, the report finds its spec as check does and shows work."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(Path(__file__).resolve().parent.parent / "specs" / "tiny.embark", tmp_path)
    assert main(["plan", "tiny.embark", "--solver", "greedy", "-o", "p.json"]) == 0
    assert main(["report", "p.json", "-o", "r.html"]) == 0
    html = (tmp_path / "r.html").read_text()
    assert "share of each table&#39;s work" in html and "no spec given" not in html
