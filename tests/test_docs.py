"""What a newcomer reads: the README, the docs, the page's own text, the license and the citation. These
check the claims that the project's measurements once contradicted, and the structure the docs promise."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from sdsat.ui.headline import mismatch_meaning

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
GLOSSARY = (ROOT / "assets" / "glossary.md").read_text()


def page_text() -> str:
    """Everything the page says: app.py, How it works, the glossary and the strings of sdsat/ui."""
    files = [ROOT / "app.py", ROOT / "assets" / "how_it_works.md", *sorted((ROOT / "sdsat" / "ui").glob("*.py"))]
    return "\n".join(path.read_text() for path in files)


def test_the_readme_is_a_product_page():
    lines = README.splitlines()
    assert len(lines) <= 150, len(lines)
    headings = [line[3:] for line in lines if line.startswith("## ")]
    assert headings == ["Results", "Quick start", "Command line", "Python API", "Deploy to a Space", "Limits",
                        "Tests", "Citation and license"], headings
    intro = README[README.index("# SDSAT"):README.index("## Results")]
    assert "sdsat_diagram.svg" in intro and "assets/screenshots/" in intro
    for image in re.findall(r"!\[[^]]*\]\(([^)]+)\)", README):
        assert (ROOT / image).is_file(), image
    results = README[README.index("## Results"):README.index("## Quick start")]
    assert "3.0×" in results and "3.5×" in results and "GPU" in results  # the paper's figures beside ours
    assert "the fastest\nvanilla" in results or "the fastest vanilla" in results
    assert "held-out" in results and "row-invariant" in README
    assert "make test" in README
    # no history of earlier rounds, stages or adapters (link targets, such as suite folders, aside)
    shown = re.sub(r"\]\([^)]*\)", "]", README).lower()
    for word in ("stage", "previous adapter", "session", "round"):
        assert word not in shown, word


def test_license_matches_the_front_matter_and_the_citation_names_the_paper():
    front = yaml.safe_load(README.split("---")[1])
    assert front["license"] == "apache-2.0"
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text and len(license_text.splitlines()) > 190
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert citation["cff-version"] == "1.2.0" and citation["license"] == "Apache-2.0"
    assert citation["title"] and citation["authors"] and citation["message"]
    paper = citation["preferred-citation"]
    assert "2403.18647" in paper["url"] and paper["authors"][0]["family-names"] == "Liu"


def test_results_is_a_reference_and_training_gives_a_verdict_per_experiment():
    results = (ROOT / "docs" / "results.md").read_text()
    for anchor in ("how-to-read-the-figures", "amd-epyc-2-cores", "intel-xeon-with-amx-2-cores", "nvidia-h200"):
        assert f"](#{anchor})" in results, anchor  # the table of contents
    assert "median over prompts" in results and "held-out" in results.lower()
    sections = re.split(r"(?m)^## ", results)[1:]
    assert not [s.splitlines()[0] for s in sections if re.search(r"\(20\d\d-", s.splitlines()[0])]  # no dated log
    training = (ROOT / "docs" / "training.md").read_text()
    experiments = training[training.index("## Experiments"):]
    for section in re.split(r"(?m)^### ", experiments)[1:]:
        first = next(line for line in section.splitlines()[1:] if line.strip())
        assert first.startswith("**Verdict"), section.splitlines()[0]
    assert training.count("shipped now") == 1  # the Experiments intro: only one stage is called shipped
    labels = [line.split("|")[1] for line in training.splitlines() if line.startswith("|")]  # table rows' first cells
    called_shipped = [label for label in labels if "shipped" in label and "shipped then" not in label]
    assert called_shipped and all("stage 4" in label for label in called_shipped), called_shipped


@pytest.mark.parametrize("claim", ["ride along", "almost no cost", "nearly free", "1.21–1.24", "1.07× a one-token",
                                   "Both give output identical"])
def test_the_page_no_longer_says_what_the_measurements_disproved(claim):
    assert claim not in page_text()


def test_the_glossary_covers_the_terms_the_page_uses():
    """Every term of the page (and of the kernel-form names the This machine panel shows, tuning.py's) is defined
    in the glossary, which the page shows beside "Metrics, defined"."""
    defined = {term.lower() for term in re.findall(r"\*\*([^*]+)\*\*", GLOSSARY)}
    for term in ("row-invariant", "routed", "per-row", "tiled", "row check", "acceptance trace", "replay",
                 "predicted", "implied", "the fastest vanilla", "held-out", "bonus token", "prompt lookup",
                 "draft tree", "runner-up", "accept test", "residual", "identical", "the same distribution",
                 "pass cost", "noisy", "sat", "k"):
        assert any(term in name for name in defined), f"{term} is not in the glossary"
    assert 'Accordion("Glossary' in (ROOT / "app.py").read_text()


def test_a_greedy_mismatch_says_what_it_means_in_each_form():
    assert "bug" in mismatch_meaning("bfloat16 row-invariant")
    assert "bug" in mismatch_meaning("float32 row-invariant per-row")
    assert "near" in mismatch_meaning("float32 routed") and "not a bug" in mismatch_meaning("float32 routed")
    assert "often differ" in mismatch_meaning("bfloat16")
    every = mismatch_meaning("")
    assert "bug" in every and "nearly tie" in every and "often differ" in every


def test_the_readme_configures_the_space_as_its_check_runs_it():
    """tests/test_space.py starts `python app.py` after installing requirements.txt alone, as this front matter
    tells a Space to."""
    front = README.split("---")[1]
    assert README.startswith("---\n") and "sdk: gradio" in front and "app_file: app.py" in front
    assert "pre-install" not in README
