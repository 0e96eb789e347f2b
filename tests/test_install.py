"""One install line gives everything the README uses: its `.[all]` extra holds every
optional part (`hf`, `train`), and the README's quickstart installs it."""

from __future__ import annotations

import tomllib

from tests.conftest import ROOT


def test_the_readme_installs_every_optional_part():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    parts = {r for name in ("hf", "train") for r in extras[name]}
    assert parts <= set(extras["all"]), parts - set(extras["all"])
    assert 'pip install -e ".[all]"' in (ROOT / "README.md").read_text()
