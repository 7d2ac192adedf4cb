"""experiments/colab_tpu_demo.ipynb runs top to bottom (nbclient, a fresh kernel) in its tiny
setting on 2 fake CPU devices, and shows the curves and report table of the run it made."""
import base64
import itertools
import json

import nbformat
import pytest
from nbclient import NotebookClient

from marl_jax.train.metrics import read_metrics

import process_util
from train_util import ROOT

NOTEBOOK = ROOT / "experiments" / "colab_tpu_demo.ipynb"


def _outputs(cell, kind):
    """Texts (stream, text/plain, text/markdown) or decoded images of a cell's outputs."""
    out = []
    for output in cell.get("outputs", []):
        if kind == "text" and output.output_type == "stream":
            out.append(output.text)
        elif output.output_type in ("execute_result", "display_data"):
            data = output.get("data", {})
            if kind == "image/png" and "image/png" in data:
                out.append(base64.b64decode(data["image/png"]))
            elif kind != "image/png" and kind in data:
                out.append(data[kind])
            elif kind == "text" and "text/plain" in data:
                out.append(data["text/plain"])
    return out


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("colab_demo")
    with pytest.MonkeyPatch.context() as patch:
        # The kernel inherits this environment when it starts.
        patch.setenv("MARL_DEMO_TINY", "1")
        patch.setenv("MARL_DEMO_WORKDIR", str(workdir))
        patch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count=2 {process_util.FAST_XLA}")
        patch.setenv("JAX_PLATFORMS", "cpu")
        notebook = nbformat.read(NOTEBOOK, as_version=4)
        NotebookClient(notebook, timeout=300, kernel_name="python3",
                       resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    return notebook, workdir


def test_notebook_has_a_marked_repo_url_and_parameter_cell():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    first_code = next(c for c in notebook.cells if c.cell_type == "code")
    assert "parameters" in first_code.metadata.get("tags", [])
    assert "REPO_URL =" in first_code.source and "EDIT" in first_code.source
    install = "\n".join(c.source for c in notebook.cells if c.cell_type == "code")
    assert '"pip", "install"' in install and "[tpu]" in install
    assert all(not c.get("outputs") for c in notebook.cells if c.cell_type == "code")


def test_notebook_runs_the_experiment_over_all_devices(executed):
    notebook, workdir = executed
    text = "\n".join("\n".join(_outputs(c, "text")) for c in notebook.cells
                     if c.cell_type == "code")
    assert "tiny setting: using the installed checkout" in text
    assert "backend: cpu, 2 devices, 1 process(es)" in text
    assert "CpuDevice(id=1)" in text
    assert "2 arms x 2 seeds" in text and "over 2 devices" in text
    rows = read_metrics(workdir)
    train = [r for r in rows if r["stage"] == "ppo"]
    assert {(r["arm"], r["seed"], r["step"]) for r in train} == {
        (a, s, t) for a in ("ppo", "ma_ppo") for s in (0, 1) for t in (1, 2, 3, 4)}
    assert len(train) == 16
    assert {r["step"] for r in rows if r["stage"] == "eval"} == {0, 2, 4}


def test_notebook_shows_the_curves_and_report_of_its_run(executed):
    notebook, workdir = executed
    last = [c for c in notebook.cells if c.cell_type == "code"][-1]
    images = _outputs(last, "image/png")
    assert images == [(workdir / "curves.png").read_bytes()]
    markdown = "\n".join(_outputs(last, "text/markdown"))
    lines = (workdir / "report.md").read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = list(itertools.takewhile(lambda line: line.startswith("|"), lines[first:]))
    assert markdown.startswith("\n".join(table))
    report = json.loads((workdir / "report.json").read_text())
    assert list(report["arms"]) == ["ppo", "ma_ppo"]
    shown = {line.split("|")[1].strip().strip("`"): line for line in table[2:]}
    assert set(shown) == {"ppo", "ma_ppo"}
    for arm, line in shown.items():
        gold = report["arms"][arm]["final_gold"]["mean"]
        assert line.split("|")[2].strip().startswith(f"{gold:.3f}")
    assert "**Verdict**" in markdown and report["verdict"][0] in markdown
