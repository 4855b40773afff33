"""The README's map of orthros.py, its CPT recipe, and the links of the user-facing pages."""

import json
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def test_readme_alg_map():
    """Each '# Alg. X, line Y' mark of the README's table is in orthros.py exactly once."""
    table = re.findall(r"^\|.*\| `(# Alg\. [12], lines? [\d-]+)` \|$", README, re.M)
    code = re.findall(r"# Alg\. [12], lines? [\d-]+", (REPO / "orthros.py").read_text())
    assert table and sorted(code) == sorted(table) == sorted(set(table))


def test_readmes_cpt_command_is_the_recipe_behind_the_results():
    """The README's SmolLM2 CPT command has the options of the run its results report."""
    import train
    command = re.search(r"^python train.py --init_from hf:models/SmolLM2.*\\\n.*$", README, re.M)[0]
    recorded = json.loads((REPO / "results" / "smollm2_cpt.json").read_text())["orthros"]["command"]
    ignored = ("init_from", "dataset", "out_dir", "overwrite", "eval_interval", "eval_iters",
               "log_interval")
    options = lambda words: {k: v for k, v in vars(train.parse_args(words)[1]).items()
                             if k not in ignored}
    readme = shlex.split(command.replace("\\\n", " "))[2:]
    assert options(readme) == options(shlex.split(recorded)[1:])


def anchors(markdown):
    """The anchors GitHub gives a page's headings."""
    headings = re.findall(r"^#+ (.*)$", markdown, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", ["README.md", "results/README.md", "exercises/README.md"])
def test_links_lead_somewhere(page):
    """Every relative link of a user-facing page names a file that exists, and a heading it has."""
    for target in re.findall(r"\]\(([^)\s]+)\)", (REPO / page).read_text()):
        if target.startswith(("http://", "https://", "#")):
            continue
        path, _, anchor = target.partition("#")
        file = (REPO / page).parent / path
        assert file.exists(), f"{page} links {target}: no such file"
        assert not anchor or anchor in anchors(file.read_text()), f"{page} links {target}"
